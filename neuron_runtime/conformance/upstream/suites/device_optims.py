"""Every optimizer of PyTorch's optimizer database (`optim_db`) on the device, against the same optimizer
on CPU: each configuration `optim_inputs_func` gives for the device (with the foreach / fused variants the
device supports), three steps on the same parameters and gradients; parameters and state must match.

Device-generic (`instantiate_device_type_tests`); run on neuron and on CPU by
`python -m neuron_runtime.conformance.upstream`. Configurations are the installed wheel's
(`torch.testing._internal.common_optimizers`); the test body is ours."""

import torch
from torch.testing._internal.common_device_type import instantiate_device_type_tests
from torch.testing._internal.common_optimizers import _get_optim_inputs_including_global_cliquey_kwargs, optim_db, optims
from torch.testing._internal.common_utils import TestCase, run_tests

_IMPL_FLAGS = ("foreach", "fused")


class TestOptimsOnDevice(TestCase):
    @optims(optim_db, dtypes=[torch.float32])
    def test_matches_cpu(self, device, dtype, optim_info):
        cls = optim_info.optim_cls
        if cls.__name__ == "SparseAdam":
            self.skipTest("SparseAdam needs sparse gradients: sparse layouts are outside the neuron device's scope")
        for oi in _get_optim_inputs_including_global_cliquey_kwargs(device, dtype, optim_info, skip=("differentiable",)):
            kwargs = dict(oi.kwargs)
            if kwargs.get("capturable") or (cls.__name__ in ("LBFGS",)):
                continue  # CUDA graphs capture / closure-driven: not a device comparison
            ref_kwargs = {k: v for k, v in kwargs.items() if k not in _IMPL_FLAGS}
            torch.manual_seed(0)
            ps = [torch.randn(5, 4, dtype=dtype), torch.randn(4, dtype=dtype), torch.randn(3, 2, 2, dtype=dtype)]
            grads = [[torch.randn_like(p) for p in ps] for _ in range(3)]
            dev = [p.clone().to(device).requires_grad_() for p in ps]
            cpu = [p.clone().requires_grad_() for p in ps]
            with self.subTest(desc=oi.desc, kwargs=str(kwargs)):
                try:
                    ref = cls(cpu, **ref_kwargs)
                except (ValueError, RuntimeError, TypeError):
                    continue  # a configuration CPU refuses (the test compares only what CPU can run)
                opt = cls(dev, **kwargs)
                for g in grads:
                    for p, q, gi in zip(dev, cpu, g):
                        p.grad = gi.to(device)
                        q.grad = gi.clone()
                    opt.step()
                    ref.step()
                self.assertEqual(dev, cpu, exact_device=False, atol=1e-5, rtol=1e-4)


instantiate_device_type_tests(TestOptimsOnDevice, globals())

if __name__ == "__main__":
    run_tests()
