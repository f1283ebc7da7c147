"""The typed contract between the benchmarks and the report: every point kind beside the dataclass of what it
measures (base.py says how they are saved), by what they run: the model alone (model.py), attention (attention.py),
several ranks (distributed.py), and the 2026 edition's FFN layouts and leaderboard timing (course.py)."""

from systems.bench.schema.attention import ATTENTION_PASSES, ATTENTION_SWEEPS, AttentionMeasured, AttentionPoint
from systems.bench.schema.base import (KINDS, MEASURED, POINT, Measured, Point, Throughput, read_measured,
                                       read_point)
from systems.bench.schema.course import (CollectiveBandwidth, FFNBandwidthMeasured, FFNBandwidthPoint, FFNMeasured,
                                         FFNPoint, LeaderboardMeasured, LeaderboardPoint, Passes)
from systems.bench.schema.distributed import (DDP_VARIANTS, FSDP_VARIANTS, AllReduceMeasured, AllReducePoint,
                                              DDPMeasured, DDPPoint, FSDPMeasured, FSDPPoint, FullStepMeasured,
                                              FullStepPoint, OptimizerMeasured, OptimizerPoint, Phases,
                                              TrainingMeasured)
from systems.bench.schema.model import (MODEL_PHASES, CheckpointMeasured, CheckpointPoint, ContextSearchMeasured,
                                        ContextSearchPoint, ModelMeasured, ModelPoint, WarmupMeasured, WarmupPoint)
from systems.bench.schema.records import SCHEMA, NewerSchema, SchemaError, from_record, to_record

__all__ = ["ATTENTION_PASSES", "ATTENTION_SWEEPS", "DDP_VARIANTS", "FSDP_VARIANTS", "KINDS", "MEASURED",
           "MODEL_PHASES", "POINT", "SCHEMA", "AllReduceMeasured", "AllReducePoint", "AttentionMeasured",
           "AttentionPoint", "CheckpointMeasured", "CheckpointPoint", "CollectiveBandwidth", "ContextSearchMeasured",
           "ContextSearchPoint", "DDPMeasured", "DDPPoint", "FFNBandwidthMeasured", "FFNBandwidthPoint",
           "FFNMeasured", "FFNPoint", "FSDPMeasured", "FSDPPoint", "FullStepMeasured", "FullStepPoint",
           "LeaderboardMeasured", "LeaderboardPoint", "Measured", "ModelMeasured", "ModelPoint", "NewerSchema",
           "OptimizerMeasured", "OptimizerPoint", "Passes", "Phases", "Point", "SchemaError", "Throughput",
           "TrainingMeasured", "WarmupMeasured", "WarmupPoint", "from_record", "read_measured", "read_point",
           "to_record"]
