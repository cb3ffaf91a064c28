"""The page shown when the logs folder holds no run: how to start one and a button that starts the demo, or, while
the demo builds its warm start, that it is running and how far it is."""

from __future__ import annotations

import shlex

import streamlit as st

from dashboard import common

DEMO_POLL_SECONDS = 2


def _demo_module():
    """`engine.demo` if this version has it, else None (the button then explains what to run instead)."""
    try:
        from engine import demo
    except ImportError:
        return None
    return demo if hasattr(demo, "start_demo") else None


def _show_progress(progress) -> None:
    """Show what `demo_progress` reports: {"fraction": 0..1, "running": bool,
    "runs": [{run, status, steps_done, steps}], "warm_start": {step, steps, loss} or None}."""
    if not isinstance(progress, dict):
        st.text(str(progress))
        return
    warm = progress.get("warm_start")
    if isinstance(warm, dict) and isinstance(warm.get("step"), int) and isinstance(warm.get("steps"), int):
        step, steps = warm["step"], max(1, warm["steps"])
        loss = warm.get("loss")
        loss_text = f", loss {loss:.3f}" if isinstance(loss, (int, float)) else ""
        st.progress(min(1.0, step / steps), text=f"warm start (supervised fine-tuning, shared by every demo run): "
                    f"step {step} of {steps}{loss_text}")
    fraction = progress.get("fraction")
    if isinstance(fraction, (int, float)):
        label = "demo training" if progress.get("running") else "demo (not training)"
        st.progress(min(1.0, max(0.0, float(fraction))), text=f"{label}: {float(fraction):.0%}")
    if progress.get("runs"):
        st.dataframe(progress["runs"], hide_index=True)


def _supervisor_running(demo, logs: str) -> bool:
    check = getattr(demo, "running_supervisor", None)
    try:
        return bool(check and check(logs))
    except Exception:
        return False


def _demo_status(demo, logs: str) -> None:
    """While the demo trains its first steps: that it is running and how far it is, polled until a run logs a step
    (then the app's own watcher switches to the run pages)."""

    @st.fragment(run_every=DEMO_POLL_SECONDS)
    def status_panel() -> None:
        progress_of = getattr(demo, "demo_progress", None)
        try:
            progress = progress_of(logs) if progress_of else {"running": True}
        except Exception as error:
            common.show_error("the demo progress", error)
            return
        stopped = isinstance(progress, dict) and progress.get("running") is False
        if stopped and not _supervisor_running(demo, logs):  # it ended before logging a step: offer it again
            st.session_state.pop("_demo_started", None)
            st.rerun(scope="app")
        st.info(f"The demo is running: it trains into {common.md(common.shown_path(logs))} in the background. First "
                "it builds the warm start that every demo run shares (a few minutes), then the runs start; this "
                "page turns into the dashboard as soon as the first run logs a step.")
        _show_progress(progress)

    status_panel()


def render() -> None:
    logs = common.logs_dir()
    st.title("PolicyLens")
    demo = _demo_module()
    if demo is not None and (st.session_state.get("_demo_started") or _supervisor_running(demo, logs)):
        _demo_status(demo, logs)
        return
    st.markdown(
        f"No runs in **{common.md(common.shown_path(logs))}** yet. Start the demo (GRPO, GRPO with process rewards, "
        "DAPO, GSPO and ASPO learning the same equation task) or a run of your own (`policylens train --help`); "
        "this page fills in by itself:"
    )
    folder = shlex.quote(logs)
    st.code(f"policylens demo --logs-dir {folder}\npolicylens train --logs-dir {folder} --algo dapo --task linear",
            language="bash")
    if demo is None:
        st.info("The one-click demo is not available in this version; run `policylens demo` in a terminal instead.")
        return
    if st.button("Start the demo", type="primary", icon=":material/play_arrow:"):
        try:
            demo.start_demo(logs)
        except Exception as error:  # e.g. no space left: say so, do not crash the page
            common.show_error("the demo start", error)
            return
        st.session_state["_demo_started"] = True
        st.rerun()
