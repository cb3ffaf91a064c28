"""plotly.js's cartesian bundle: the part of plotly.js the dashboard draws with, a third of the whole.

The plotly package ships the whole of plotly.js (4.8 MB, every trace type: maps, 3D, tables...). The dashboard's
figures use four trace types, all in plotly.js's cartesian bundle (1.5 MB), which plotly publishes on npm as
`plotly.js-cartesian-dist-min`. A browser that has never run plotly.js before compiles the whole of it in one long
task before a page's first figure appears: 0.88 s for the whole bundle against 0.33 s for the cartesian one, in
headless chromium on this project's 2-core machine (docs/benchmarks.md, "plotly.js's cartesian bundle").

`python -m dashboard.plotly_bundle` (run by `make install`) fetches the bundle of the plotly.js version the
installed plotly package carries, once, when the dashboard is installed: never while it runs (the dashboard asks
nothing of the internet). The tarball is checked against the sha512 the registry publishes for it before anything
is written. Without it (not fetched, or plotly changed since), the dashboard serves plotly's whole bundle, as
before; the shareable report embeds the same script as the dashboard serves.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import os
import secrets
import sys
import tarfile
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

from plotly.offline import get_plotlyjs, get_plotlyjs_version

REGISTRY = "https://registry.npmjs.org"
PACKAGE = "plotly.js-cartesian-dist-min"
FILE_IN_TARBALL = "package/plotly-cartesian.min.js"
BUNDLE_DIR = Path(__file__).resolve().parent / "plotly_js"
"""Where the fetched bundle is kept (next to the dashboard's code, so each installation has its own)."""
TRACE_TYPES = ("bar", "heatmap", "histogram", "scatter")
"""The trace types the dashboard's figures use: each must be in the bundle (the browser tests check every figure
drawn is drawn as the type it asked for)."""
MAX_TARBALL_BYTES = 20_000_000  # the 4.1.1 tarball is 0.5 MB


def bundle_path(version: str | None = None) -> Path:
    """Where the cartesian bundle of plotly.js `version` (default: the installed plotly's) is kept."""
    return BUNDLE_DIR / f"plotly-cartesian-{version or get_plotlyjs_version()}.min.js"


def served_name() -> str:
    """The file name of the plotly.js the dashboard serves and the report embeds: the cartesian bundle when it was
    fetched for the installed plotly's version, else plotly's whole bundle. The version is in the name, so a
    browser never runs a cached script of another plotly."""
    version = get_plotlyjs_version()
    cartesian = bundle_path(version)
    return cartesian.name if cartesian.is_file() else f"plotly-{version}.min.js"


def served_script() -> str:
    """The text of the script `served_name()` names."""
    cartesian = bundle_path()
    return cartesian.read_text(encoding="utf-8") if cartesian.is_file() else get_plotlyjs()


def write_whole(path: Path, data: bytes) -> None:
    """Write `path` so that a reader sees the old file or the whole new one, never part of it (a temporary file
    beside it, then renamed; removed if the write fails). Not `tempfile`: its files are private (0600), and the
    server that reads this one may run as another user than the one who installed it."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.part")
    try:
        with open(temporary, "xb") as out:
            out.write(data)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def _get(url: str, timeout: float) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        body = response.read(MAX_TARBALL_BYTES + 1)
    if len(body) > MAX_TARBALL_BYTES:
        raise ValueError(f"{url} sent more than {MAX_TARBALL_BYTES:,} bytes; a plotly.js tarball is far smaller")
    return body


def fetch(version: str | None = None, registry: str = REGISTRY, timeout: float = 60.0) -> Path:
    """Fetch the cartesian bundle of plotly.js `version` (default: the installed plotly's) from the npm registry
    into `bundle_path(version)` and return that path; an existing copy is kept. The tarball must come from the
    registry's own host and match the sha512 the registry lists for it: otherwise ValueError, and nothing is
    written."""
    version = version or get_plotlyjs_version()
    target = bundle_path(version)
    if target.is_file():
        return target
    registry = registry.rstrip("/")
    metadata = json.loads(_get(f"{registry}/{PACKAGE}/{version}", timeout))
    dist = metadata.get("dist") or {}
    tarball, integrity = dist.get("tarball", ""), dist.get("integrity", "")
    if urlsplit(tarball).netloc != urlsplit(registry).netloc:
        raise ValueError(f"the registry names a tarball at {tarball!r}, not on {registry}: not fetched")
    algorithm, _, expected = integrity.partition("-")
    if algorithm != "sha512" or not expected:
        raise ValueError(f"the registry lists no sha512 for {PACKAGE} {version} (integrity {integrity!r})")
    body = _get(tarball, timeout)
    actual = base64.b64encode(hashlib.sha512(body).digest()).decode()
    if actual != expected:
        raise ValueError(f"{tarball} does not match the registry's sha512 (expected {expected}, got {actual}): "
                         "not written")
    with tarfile.open(fileobj=io.BytesIO(body), mode="r:gz") as archive:
        try:  # read, never extracted: no path of the archive is used
            script = archive.extractfile(FILE_IN_TARBALL).read()
        except (KeyError, AttributeError):  # no such member, or not a file
            raise ValueError(f"{tarball} holds no file {FILE_IN_TARBALL}") from None
    if f"v{version}".encode() not in script[:500]:
        raise ValueError(f"{FILE_IN_TARBALL} in {tarball} does not say it is plotly.js v{version}")
    BUNDLE_DIR.mkdir(exist_ok=True)
    write_whole(target, script)
    for old in BUNDLE_DIR.glob("plotly-cartesian-*.min.js"):
        if old != target:
            old.unlink(missing_ok=True)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--registry", default=REGISTRY, help="npm registry (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        path = fetch(registry=args.registry)
    except (OSError, ValueError, tarfile.TarError) as error:
        print(f"plotly.js's cartesian bundle was not fetched ({error}); the dashboard serves plotly's whole bundle "
              "(first visits to a page about 0.5 s slower).", file=sys.stderr)
        return 1
    print(f"plotly.js cartesian bundle: {path.name} ({path.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
