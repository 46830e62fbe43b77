"""rlcheck: keeps RL post-training honest by comparing rollout and trainer logprobs every step.

    from rlcheck import Monitor, MonitorConfig, HaltConfig, StepBatch, MismatchHalt
    mon = Monitor(MonitorConfig(run_dir="runs/x", sinks=("jsonl",)))
    report = mon.observe(step, StepBatch.from_ragged(logp_rollout=..., logp_train=..., request_ids=...))

Only numpy (and pyarrow for dumps) is imported here; vLLM, transformers, Ray, DeepSpeed, wandb and
torch are imported by the modules that need them.
"""

from rlcheck.core.batch import StepBatch
from rlcheck.core.correction import CorrectionConfig
from rlcheck.core.detect import Alarm, DetectorsConfig
from rlcheck.core.monitor import HaltConfig, Monitor, MonitorConfig
from rlcheck.core.quarantine import QuarantineConfig
from rlcheck.core.run import Run
from rlcheck.core.stats import StatsConfig
from rlcheck.core.sync_check import SyncCheckConfig
from rlcheck.core.types import Offender, StepReport
from rlcheck.errors import (
    ActorDiedError,
    ConfigError,
    GuardViolation,
    InputError,
    MismatchHalt,
    PathError,
    RecordWriteError,
    RLCheckError,
    RunDirError,
    SinkInitError,
    UnsupportedVLLMError,
)

__version__ = "0.1.0"

__all__ = [
    "ActorDiedError", "Alarm", "ConfigError", "CorrectionConfig", "DetectorsConfig", "GuardViolation", "HaltConfig",
    "InputError", "MismatchHalt", "Monitor", "MonitorConfig", "Offender", "PathError", "QuarantineConfig",
    "RLCheckError", "RecordWriteError", "Run", "RunDirError", "SinkInitError", "StatsConfig", "StepBatch",
    "StepReport", "SyncCheckConfig", "UnsupportedVLLMError", "__version__",
]
