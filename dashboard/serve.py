"""`python -m dashboard.serve run dashboard/streamlit_app.py [streamlit options] -- --logs-dir DIR`: Streamlit's own
command line (`streamlit run ...`, the same arguments), with what a first page needs loaded on a thread while the
server starts: the dashboard's libraries (pandas, DuckDB, plotly), the logs folder's reader (shared with every session
through `queries.get_reader`'s cache: 1.9 s to open on a run of 100M token rows) and torch (the pages that recompute
objectives or corrections). Without it the first visit waited for all of that after the server was up.
"""

from __future__ import annotations

import sys
import threading


def _warm_up(logs_dir: str) -> None:
    try:
        from dashboard import charts, queries  # noqa: F401  pandas, pyarrow, DuckDB, plotly

        queries.get_reader(logs_dir)
        import torch  # noqa: F401
    except Exception:  # nothing is lost: the first page loads what failed here, and shows why if it fails again
        pass


def main(argv: list[str]) -> None:
    app_args = argv[argv.index("--") + 1:] if "--" in argv else []
    logs_dir = next((app_args[i + 1] for i, arg in enumerate(app_args[:-1]) if arg == "--logs-dir"), None)
    if logs_dir is not None:
        threading.Thread(target=_warm_up, args=(logs_dir,), name="policylens-warm-up", daemon=True).start()
    from streamlit.web import cli

    sys.argv = ["streamlit", *argv]
    cli.main()


if __name__ == "__main__":
    main(sys.argv[1:])
