"""A worker started by torchelastic: attaches to our segment from torchrun's variables, adds to a Stat."""

import os
import sys

import shmstat
from shmstat import Aggregation

stat = shmstat.Stat("step", [Aggregation.COUNT], 0.05, group="train")
for _ in range(50):
    stat.add(1.0)
with open(os.path.join(sys.argv[1], f"worker-{os.environ['RANK']}"), "w") as f:
    f.write(os.environ["TORCHELASTIC_RUN_ID"])
shmstat.shutdown()
