"""Write DIR/config.yaml and the loss-spike demo's data (a unit change planted in one shard) for docs/goodput.md.

    python examples/goodput/make_config.py /tmp/goodput
    CHAOS_DIR=/tmp/goodput PYTHONPATH=examples/goodput \\
        steadytrain train /tmp/goodput/config.yaml --nproc 2 --max-restarts 2 --run-dir /tmp/goodput/run
    steadytrain goodput /tmp/goodput/run
"""

import random
import sys
from pathlib import Path

import yaml

from steadytrain.diagnose.spikedemo import bad_shard_at, make_dataset, train_config

root = Path(sys.argv[1])
root.mkdir(parents=True, exist_ok=True)
rows = sorted(random.Random(7).sample(range(32), 20))
data = make_dataset(root / "cents", shards=160, bad_shard=bad_shard_at(80, 160), bad_rows=rows)
cfg = train_config(data, steps=100, policy="rollback")  # a spike at step 41, rolled back to step 40
cfg["run"].update(log_every=5, callbacks=["chaos:hooks"])
cfg["distributed"] = {"watchdog_s": 5}
(root / "config.yaml").write_text(yaml.safe_dump(cfg))
