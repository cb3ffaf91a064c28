"""`policylens dashboard` and `policylens demo`: serving the dashboard, with the demo's runs training beside it."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

from engine.cli.common import add_logs_dir


def add_dashboard_command(subparsers) -> None:
    parser = subparsers.add_parser("dashboard", help="start the dashboard (http://127.0.0.1:8501 by default)")
    add_logs_dir(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=8501)
    parser.set_defaults(func=run_dashboard)


def dashboard_command(logs_dir: str, host: str = "127.0.0.1", port: int = 8501) -> list[str]:
    """The `streamlit run` command line that serves the dashboard for a logs folder (absolute, so the app finds
    it whatever its working directory), through `dashboard.serve`, which loads what a first page needs while the
    server starts."""
    app = Path(__file__).resolve().parents[2] / "dashboard" / "streamlit_app.py"
    return [
        sys.executable, "-m", "dashboard.serve", "run", str(app),
        "--server.address", host, "--server.port", str(port),
        "--server.headless", "true", "--browser.gatherUsageStats", "false",
        "--client.toolbarMode", "minimal",  # no "Deploy" button: this is a local tool
        # No full garbage collection after every rerun (Streamlit's default): with torch and pandas loaded it held
        # the interpreter for ~60 ms while the rerun's last messages waited to be sent. No watching of the app's
        # source files for edits: nobody edits them while looking at runs.
        "--runner.postScriptGC", "false", "--server.fileWatcherType", "none",
        "--", "--logs-dir", str(Path(logs_dir).resolve()),
    ]


def run_dashboard(args: argparse.Namespace) -> int:
    import subprocess

    command = dashboard_command(args.logs_dir, args.host, args.port)
    print(f"PolicyLens dashboard on http://{args.host}:{args.port} (logs: {command[-1]}); Ctrl+C stops it.")
    server = subprocess.Popen(command)
    # A SIGTERM to this process must not orphan the server (it would keep the port): pass it on.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: server.terminate())
    try:
        return server.wait()
    except KeyboardInterrupt:  # the server got the same Ctrl+C from the terminal and shuts down by itself
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.terminate()
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        if server.poll() is None:
            server.terminate()
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()



def add_demo_command(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo", help="train the demo comparison in the background and serve the dashboard (the README's run command)"
    )
    add_logs_dir(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=8501)
    parser.add_argument("--fresh", action="store_true", help="delete the demo runs and train them again")
    parser.add_argument("--no-browser", action="store_true",
                        help="do not open the dashboard in a browser (it is opened only on a desktop)")
    parser.set_defaults(func=run_demo)


def has_desktop(environ=None, platform: str | None = None) -> bool:
    """Whether a browser window can be opened: macOS and Windows always, elsewhere only under X11 or Wayland (on a
    server `webbrowser` would start a text browser in the terminal instead)."""
    environ = os.environ if environ is None else environ
    platform = platform or sys.platform
    return platform in ("darwin", "win32") or bool(environ.get("DISPLAY") or environ.get("WAYLAND_DISPLAY"))


def local_url(host: str, port: int) -> str:
    """The address a browser on this machine uses for a server listening on `host` (all interfaces: loopback)."""
    host = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def open_browser_when_up(url: str, timeout: float = 60.0) -> threading.Thread:
    """Open `url` in the desktop's browser as soon as the server answers there (in a background thread)."""
    import urllib.request
    import webbrowser

    def wait_then_open() -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url, timeout=2):
                    webbrowser.open(url)
                    return
            except OSError:
                time.sleep(0.5)

    thread = threading.Thread(target=wait_then_open, daemon=True)
    thread.start()
    return thread


def run_demo(args: argparse.Namespace) -> int:
    from engine import demo
    from engine.runlog import list_runs

    logs_dir = Path(args.logs_dir)
    logs_dir.mkdir(parents=True, exist_ok=True)
    statuses = {run["run"]: run["status"] for run in list_runs(logs_dir)}
    demo_unfinished = any(statuses.get(run.name, "missing") != "finished" for run in demo.DEMO_RUNS)
    started = False
    if args.fresh or not statuses or (demo.demo_runs_present(logs_dir) and demo_unfinished):
        print(f"policylens: training the demo runs in the background (log: {logs_dir / '.demo' / 'demo.log'})")
        demo.start_demo(logs_dir, fresh=args.fresh)
        started = True
    if not args.no_browser and has_desktop():
        open_browser_when_up(local_url(args.host, args.port))
    try:
        return run_dashboard(args)
    except KeyboardInterrupt:
        return 0
    finally:
        if started:
            print("policylens: stopping the demo training after its current step")
            demo.stop_demo(logs_dir)


