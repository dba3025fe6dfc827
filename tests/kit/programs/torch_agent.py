"""Runs PyTorch's real torchelastic agent (``elastic_launch``) with our CollectorMetricHandler configured.

Usage: ``python torch_agent.py JOB WORKER_SCRIPT OUT_DIR``. The agent's platform metrics (group
``torchelastic``) go through torch's own ``put_metric``/``prof`` into our handler and on to our collector.
"""

import sys

import torch.distributed.elastic.metrics as torch_metrics
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

import shmstat
from elastic.metrics import CollectorMetricHandler

job, worker, out_dir = sys.argv[1], sys.argv[2], sys.argv[3]
shmstat.init(job, rank=99, local_rank=63)  # the agent is not a rank; it takes a spare entry to publish
torch_metrics.configure(CollectorMetricHandler(), "torchelastic")
config = LaunchConfig(
    min_nodes=1, max_nodes=1, nproc_per_node=2, run_id=job, rdzv_backend="c10d", rdzv_endpoint="localhost:0",
    max_restarts=0, monitor_interval=0.1, start_method="spawn",
)
elastic_launch(config, sys.executable)("-u", worker, out_dir)
shmstat.shutdown()
