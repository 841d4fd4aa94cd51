"""One rank of `torchrun --nproc-per-node 2 ddp_train.py OUT`: the shared tiny LM, no dropout (each rank
would draw the same masks), per-device batch 2; rank 0 writes the logged losses to OUT/losses.json."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ["HF_HUB_OFFLINE"] = "1"

from hf_helpers import run_trainer  # noqa: E402

out = Path(sys.argv[1])
losses, trainer = run_trainer(out / "ddp", use_cpu=False, dropout=0.0, per_device_train_batch_size=2,
                              save_strategy="no")
assert trainer.args.world_size == 2 and trainer.args.device.type == "neuron", trainer.args
if trainer.args.process_index == 0:
    (out / "losses.json").write_text(json.dumps({"losses": losses, "distributed_type": str(
        trainer.accelerator.distributed_type)}))
