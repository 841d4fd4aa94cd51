"""`torch_neuronx`: the import name Hugging Face's libraries look for, provided by neuron-runtime.

Transformers and Accelerate detect a Neuron device by `importlib.util.find_spec("torch_neuronx")`, then
ask `torch.neuron.is_available()`. This package answers the first question so that their Neuron code
paths (model on `neuron:0`, `DistributedType.MULTI_NEURON`, `torch_compile_backend="neuron"`) pick
neuron-runtime's device with no user code change. It is not AWS's `torch-neuronx` and has none of its
API (`trace`, ...): importing it only makes sure the runtime is loaded.

AWS's `torch-neuronx` distribution uses the same import name. Installed side by side, one would
overwrite the other's files; neuron-runtime refuses to load then, with an error naming both
(`neuron_runtime.device._conflicts`). See README ("Hugging Face").
"""

from neuron_runtime.device import _conflicts

_conflicts.check()

import neuron_runtime  # noqa: E402,F401 - loads the device (also done by `import torch`)

__version__ = neuron_runtime.__version__
__neuron_runtime__ = True
