"""The typed contract between the benchmarks and the report: every point kind beside the dataclass of what it
measures (base.py says how they are saved), by what they run: the model alone (model.py), attention (attention.py),
several ranks (distributed.py), ranks laid out as replicas x shards (layouts.py), and the 2026 edition's FFN
layouts and leaderboard timing (course.py)."""

from systems.bench.schema.attention import ATTENTION_PASSES, ATTENTION_SWEEPS, AttentionMeasured, AttentionPoint
from systems.bench.schema.base import (KINDS, MEASURED, POINT, Measured, Point, Throughput, read_measured,
                                       read_point)
from systems.bench.schema.course import (CollectiveBandwidth, FFNBandwidthMeasured, FFNBandwidthPoint, FFNMeasured,
                                         FFNPoint, LeaderboardMeasured, LeaderboardPoint, Passes)
from systems.bench.schema.distributed import (DDP_VARIANTS, FSDP_VARIANTS, AllReduceMeasured, AllReducePoint,
                                              DDPMeasured, DDPPoint, FSDPMeasured, FSDPPoint, FullStepMeasured,
                                              FullStepPoint, OptimizerMeasured, OptimizerPoint, Phases,
                                              TrainingMeasured, TrainingPoint)
from systems.bench.schema.layouts import (LAYOUT_BUCKET_MB, LAYOUT_VARIANTS, AxisComm, LayoutMeasured,
                                          LayoutPoint)
from systems.bench.schema.model import (MODEL_PHASES, CheckpointMeasured, CheckpointPoint, ContextSearchMeasured,
                                        ContextSearchPoint, ModelMeasured, ModelPoint, WarmupMeasured, WarmupPoint)
from systems.bench.schema.records import SCHEMA, NewerSchema, SchemaError, check_schema, from_record, to_record

__all__ = ["ATTENTION_PASSES", "ATTENTION_SWEEPS", "AllReduceMeasured", "AllReducePoint", "AttentionMeasured",
           "AttentionPoint", "AxisComm", "CheckpointMeasured", "CheckpointPoint", "CollectiveBandwidth",
           "ContextSearchMeasured", "ContextSearchPoint", "DDPMeasured", "DDPPoint", "DDP_VARIANTS",
           "FFNBandwidthMeasured", "FFNBandwidthPoint", "FFNMeasured", "FFNPoint", "FSDPMeasured", "FSDPPoint",
           "FSDP_VARIANTS", "FullStepMeasured", "FullStepPoint", "KINDS", "LAYOUT_BUCKET_MB", "LAYOUT_VARIANTS",
           "LayoutMeasured", "LayoutPoint", "LeaderboardMeasured", "LeaderboardPoint", "MEASURED", "MODEL_PHASES",
           "Measured", "ModelMeasured", "ModelPoint", "NewerSchema", "OptimizerMeasured", "OptimizerPoint", "POINT",
           "Passes", "Phases", "Point", "SCHEMA", "SchemaError", "Throughput", "TrainingMeasured", "TrainingPoint",
           "WarmupMeasured", "WarmupPoint", "check_schema", "from_record", "read_measured", "read_point", "to_record"]
