"""The page shown when the logs folder holds no run: how to start one, and a button that starts the demo."""

from __future__ import annotations

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
        st.write(progress)
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


def render() -> None:
    logs = common.logs_dir()
    st.title("PolicyLens")
    st.markdown(
        f"""
No runs in **{common.md(logs)}** yet. Start the demo (GRPO, GRPO with process rewards, DAPO, GSPO and ASPO learning the
same equation task) or a run of your own (`policylens train --help`); this page fills in by itself:

```bash
policylens demo --logs-dir {logs}
policylens train --logs-dir {logs} --algo dapo --task linear
```
"""
    )
    demo = _demo_module()
    if demo is None:
        st.info("The one-click demo is not available in this version; run `policylens demo` in a terminal instead.")
        return
    if st.button("Start the demo", type="primary", icon=":material/play_arrow:"):
        try:
            demo.start_demo(logs)
            st.session_state["_demo_started"] = True
        except Exception as error:  # e.g. already running, or no space left: say so, do not crash the page
            common.show_error("the demo start", error)

    running = st.session_state.get("_demo_started") or _supervisor_running(demo, logs)

    @st.fragment(run_every=DEMO_POLL_SECONDS if running else None)
    def progress_panel() -> None:
        progress_of = getattr(demo, "demo_progress", None)
        if progress_of is None:
            return
        try:
            _show_progress(progress_of(logs))
        except Exception as error:
            common.show_error("the demo progress", error)

    if running:  # before the first click there is nothing to report
        progress_panel()
