"""`python -m dashboard.serve run dashboard/streamlit_app.py [streamlit options] -- --logs-dir DIR`: Streamlit's own
command line (`streamlit run ...`, the same arguments), with what a first page needs loaded before a page asks: the
dashboard's libraries (pandas, DuckDB, plotly; imported first, on the main thread, as Streamlit would import most of
them anyway), then, on a thread while the server starts, the logs folder's reader (shared with every session through
`queries.get_reader`'s cache: 1.9 s to open on a run of 100M token rows) and torch (the pages that recompute
objectives or corrections). Without it the first visit waited for all of that after the server was up.

Nothing is imported on the thread while Streamlit imports its own modules: plotly looks pandas up in `sys.modules`
without waiting for it, so importing pandas there while Streamlit imported plotly once stopped the server. torch
waits for Streamlit's runtime to exist (the server is then past its imports).

Before the server starts, the installed plotly's plotly.js is put where Streamlit's static file serving finds it
and that serving is turned on (`dashboard.figures`: the pages draw their figures with it); when the folder cannot
be written, the figures are drawn by `st.plotly_chart` instead.

torch computes on one thread here (OMP_NUM_THREADS=1 unless set): what the pages ask of it (objectives and
corrections, 32 completions at a time) is a few hundred small operations, and torch's second thread waits, spinning,
for a core the browser is drawing on: a step's table of corrections took 0.87 s on two threads with the other core
busy, 0.31 s on one (0.28 s on two with it idle).
"""

from __future__ import annotations

import os
import sys
import threading
import time


def _warm_up(logs_dir: str) -> None:
    from streamlit.runtime import Runtime  # both imported by `main` already

    from dashboard import queries

    try:
        queries.get_reader(logs_dir)
        while not Runtime.exists():
            time.sleep(0.05)
        import torch  # noqa: F401
    except Exception:  # nothing is lost: the first page loads what failed here, and shows why if it fails again
        pass


def main(argv: list[str]) -> None:
    from streamlit.runtime import Runtime  # noqa: F401  (for `_warm_up`)
    from streamlit.web import cli

    from dashboard import charts, common, figures, queries  # noqa: F401  pandas, pyarrow, DuckDB, plotly, streamlit

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # read by torch when it is imported (see above)

    # the folder exactly as the app will name it (the reader's cache key)
    logs_dir = common.logs_dir(argv[argv.index("--") + 1:] if "--" in argv else [])
    threading.Thread(target=_warm_up, args=(logs_dir,), name="policylens-warm-up", daemon=True).start()
    if argv[:1] == ["run"] and figures.publish_plotly_js():
        argv = [*argv[:2], "--server.enableStaticServing", "true", *argv[2:]]
    sys.argv = ["streamlit", *argv]
    cli.main()


if __name__ == "__main__":
    main(sys.argv[1:])
