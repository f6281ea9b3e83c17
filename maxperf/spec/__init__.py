"""Every decision about a request, made once, in plain Python (no jax): the configs and presets, `key=value`
overrides with MaxText's spellings, remat policies and what each keeps, the topology catalog and the chips'
datasheets, the resolved mesh, the logical-axis and attention-kernel rules, and the resolved request that the
models, perfmodel, aot and the CLI all read.

    from maxperf import spec
    req = spec.resolve("v5p-1024", "llama3-8b", ["per_device_batch_size=2"])
    req.mesh.shown(), req.model.d_model, req.train.remat_policy, req.topology.chips
"""

from maxperf.spec.configs import Configs
from maxperf.spec.errors import DoesNotFit, MaxperfError
from maxperf.spec.mesh import Mesh
from maxperf.spec.model import ModelConfig
from maxperf.spec.parallelism import ParallelismConfig
from maxperf.spec.request import Request, resolve
from maxperf.spec.topology import Topology
from maxperf.spec.train import TrainConfig

__all__ = ["Configs", "DoesNotFit", "MaxperfError", "Mesh", "ModelConfig", "ParallelismConfig", "Request",
           "Topology", "TrainConfig", "resolve"]
