"""`dashboard.plotly_bundle`: plotly.js's cartesian bundle fetched from an npm registry (here a loopback server
with a tarball made in the test), written only when the tarball matches the registry's sha512, and served (and
embedded in reports) instead of plotly's whole bundle once fetched."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import tarfile
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from plotly.offline import get_plotlyjs, get_plotlyjs_version

from dashboard import figures, plotly_bundle

VERSION = get_plotlyjs_version()
SCRIPT = f"/**\n* plotly.js (cartesian - minified) v{VERSION}\n*/\nwindow.Plotly = {{}};\n".encode()


def tarball(files: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as archive:
        for name, body in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(body)
            archive.addfile(info, io.BytesIO(body))
    return out.getvalue()


def sha512(body: bytes) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(body).digest()).decode()


@contextmanager
def registry(routes):
    """A loopback npm registry: `routes(base_url)` -> {path: body}; every request's path is recorded."""
    asked = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            asked.append(self.path)
            body = served.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    base = f"http://127.0.0.1:{server.server_port}"
    served = routes(base)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        yield base, asked
    finally:
        server.shutdown()
        server.server_close()


def package(tar: bytes, integrity: str, tarball_url=None):
    def routes(base):
        url = tarball_url or f"{base}/{plotly_bundle.PACKAGE}/-/bundle.tgz"
        meta = json.dumps({"version": VERSION, "dist": {"tarball": url, "integrity": integrity}}).encode()
        return {f"/{plotly_bundle.PACKAGE}/{VERSION}": meta, f"/{plotly_bundle.PACKAGE}/-/bundle.tgz": tar}
    return registry(routes)


@pytest.fixture
def bundle_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(plotly_bundle, "BUNDLE_DIR", tmp_path / "plotly_js")
    return tmp_path / "plotly_js"


def test_the_bundle_is_fetched_checked_and_then_served_and_embedded(bundle_dir, tmp_path, monkeypatch):
    assert plotly_bundle.served_name() == f"plotly-{VERSION}.min.js"  # not fetched: plotly's whole bundle
    assert plotly_bundle.served_script() == get_plotlyjs()
    tar = tarball({"package/README.md": b"readme", plotly_bundle.FILE_IN_TARBALL: SCRIPT})
    with package(tar, sha512(tar)) as (base, asked):
        path = plotly_bundle.fetch(registry=base)
        assert plotly_bundle.fetch(registry=base) == path  # kept: asked once
    assert asked == [f"/{plotly_bundle.PACKAGE}/{VERSION}", f"/{plotly_bundle.PACKAGE}/-/bundle.tgz"]
    assert [p.name for p in bundle_dir.iterdir()] == [f"plotly-cartesian-{VERSION}.min.js"]
    assert path.read_bytes() == SCRIPT
    assert plotly_bundle.served_name() == path.name
    assert plotly_bundle.served_script() == SCRIPT.decode()

    # The server's copy is the fetched bundle, under its own name.
    monkeypatch.setattr(figures, "STATIC_DIR", tmp_path / "static")
    monkeypatch.setattr(figures, "PLOTLY_JS", plotly_bundle.served_name())
    assert figures.publish_plotly_js()
    assert (tmp_path / "static" / path.name).read_bytes() == SCRIPT


@pytest.mark.parametrize("case", ["altered tarball", "tarball elsewhere", "no sha512", "no bundle inside",
                                  "another version"])
def test_a_bundle_that_cannot_be_trusted_is_refused_and_nothing_is_written(bundle_dir, case):
    tar = tarball({plotly_bundle.FILE_IN_TARBALL: SCRIPT})
    integrity, elsewhere = sha512(tar), None
    if case == "altered tarball":
        integrity = sha512(tar + b"\0")
    elif case == "tarball elsewhere":
        elsewhere = "http://example.invalid/bundle.tgz"
    elif case == "no sha512":
        integrity = "sha1-" + base64.b64encode(hashlib.sha1(tar).digest()).decode()
    elif case == "no bundle inside":
        tar = tarball({"package/other.js": SCRIPT})
        integrity = sha512(tar)
    else:
        tar = tarball({plotly_bundle.FILE_IN_TARBALL: SCRIPT.replace(f"v{VERSION}".encode(), b"v0.0.1")})
        integrity = sha512(tar)
    expected = {"altered tarball": "does not match the registry's sha512", "tarball elsewhere": "not on",
                "no sha512": "no sha512", "no bundle inside": "holds no", "another version": "does not say"}[case]
    with package(tar, integrity, elsewhere) as (base, asked), pytest.raises(ValueError, match=expected):
        plotly_bundle.fetch(registry=base)
    if case == "tarball elsewhere":
        assert asked == [f"/{plotly_bundle.PACKAGE}/{VERSION}"]  # the tarball was not even asked for
    assert not bundle_dir.exists() or not any(bundle_dir.iterdir())
    assert plotly_bundle.served_name() == f"plotly-{VERSION}.min.js"


def test_an_unreachable_registry_is_said_and_the_whole_bundle_stays(bundle_dir, capsys):
    with registry(lambda base: {}) as (base, _):
        pass  # shut down: nothing listens there any more
    assert plotly_bundle.main(["--registry", base]) == 1
    assert "not fetched" in capsys.readouterr().err
    assert plotly_bundle.served_name() == f"plotly-{VERSION}.min.js"


def test_the_installation_fetched_the_bundle_of_the_installed_plotly():
    """`make install` (scripts/install.sh) fetches it: what users install is what the browser tests draw with."""
    assert plotly_bundle.bundle_path().is_file(), "run `python -m dashboard.plotly_bundle`"
    assert plotly_bundle.bundle_path().name == figures.PLOTLY_JS


def test_a_written_bundle_is_readable_by_the_server_and_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    """The server may run as another user than the installer: the file gets the umask's permissions (a `tempfile`
    file would be private, 0600). A write that fails leaves neither the file nor its temporary beside it."""
    import os

    target = tmp_path / "plotly-cartesian-0.0.1.min.js"
    previous = os.umask(0o022)
    try:
        plotly_bundle.write_whole(target, SCRIPT)
    finally:
        os.umask(previous)
    assert target.read_bytes() == SCRIPT
    assert target.stat().st_mode & 0o777 == 0o644
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        plotly_bundle.write_whole(tmp_path / "other.js", SCRIPT)
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]
