"""Every op_db entry's `error_inputs` on the device: the op must raise the error type and message PyTorch's
own OpInfo states (the messages CPU and CUDA give). Device-generic: run through
`instantiate_device_type_tests`, on neuron and on CPU, by `python -m neuron_runtime.conformance.upstream`.

The inputs and expected errors are the installed wheel's (`torch.testing._internal`); the test body is ours.
The class and test carry the names of PyTorch's own error-inputs test (`TestCommon.test_errors`), so the
skips and expected failures each OpInfo declares for that test apply here too."""

import torch
from torch.testing._internal.common_device_type import OpDTypes, instantiate_device_type_tests, ops
from torch.testing._internal.common_methods_invocations import op_db
from torch.testing._internal.common_utils import TestCase, run_tests

_WITH_ERRORS = [op for op in op_db if op.error_inputs_func is not None]


class TestCommon(TestCase):
    @ops(_WITH_ERRORS, dtypes=OpDTypes.none)
    def test_errors(self, device, op):
        for ei in op.error_inputs(device):
            si = ei.sample_input
            if not isinstance(si.input, torch.Tensor):
                continue  # Python numbers only (`__rsub__(2, 3)`): nothing runs on a device
            with self.subTest(sample=repr(si)[:200]), self.assertRaisesRegex(ei.error_type, ei.error_regex):
                out = op(si.input, *si.args, **si.kwargs)
                if isinstance(out, torch.Tensor) and out.numel():
                    out.sum().item()  # errors some devices raise only when the result is used


instantiate_device_type_tests(TestCommon, globals())

if __name__ == "__main__":
    run_tests()
