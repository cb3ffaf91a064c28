"""Import what other trainers dump into a PolicyLens run: `policylens import trl|verl|prime-rl|nemo-rl|slime DIR`.

    policylens import trl      runs/qwen-grpo --run-name qwen-grpo         # TRL's completions Parquet files
    policylens import verl     rollouts/      --tokenizer ~/models/qwen    # verl's rollout JSONL dumps
    policylens import prime-rl outputs/       --tokenizer ~/models/qwen    # prime-rl token exports, every token
    policylens import nemo-rl  logs/exp_001   --tokenizer ~/models/qwen    # NeMo-RL train_data_step<N>.jsonl
    policylens import slime    debug/         --tokenizer ~/models/qwen    # slime debug rollout + train dumps

TRL and verl dumps hold text and one score per completion (`trl.py`, `verl.py`; `--tokenizer` tokenizes the
completion again, no log-probs). prime-rl, NeMo-RL and slime dumps hold every token with the sampler's and the
trainer's log-probs (`prime_rl.py`, `nemo_rl.py`, `slime.py`; the shared split and columns in `token_dumps.py`;
`--tokenizer` gives the token texts, the dumps hold ids). One module per format, each citing the writer's source.

Guarantees (`run.py`): idempotent (a second import adds only new steps), `--follow` for a run still being
written, a damaged file or line reported by name and line and skipped, the rest imported, nothing already
imported lost, a folder without dump files an error that creates nothing; everything written through RunWriter.
"""

from engine.importers.base import SETTLE_SECONDS, ImportReport, as_text, components_json, run_name_from_folder
from engine.importers.run import SOURCES, Importer, follow, import_run, import_trl, import_verl

__all__ = ["SETTLE_SECONDS", "SOURCES", "ImportReport", "Importer", "as_text", "components_json", "follow",
           "import_run", "import_trl", "import_verl", "run_name_from_folder"]
