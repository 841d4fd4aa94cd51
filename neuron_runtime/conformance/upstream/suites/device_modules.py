"""Every `torch.nn` module of PyTorch's module database (`module_db`) on the device, against the same
module on CPU: forward outputs, input and parameter gradients, in training and eval mode; and each
module's `module_error_inputs` (construction or forward must raise the stated error).

Device-generic (`instantiate_device_type_tests`); run on neuron and on CPU by
`python -m neuron_runtime.conformance.upstream`. Inputs and expected errors are the installed wheel's
(`torch.testing._internal.common_modules`); the test bodies are ours. On CPU the comparison is CPU with
itself: what it checks there is that the test itself holds (a random module draws the same numbers twice)."""

import copy

import torch
from torch.nn.parameter import is_lazy
from torch.testing._internal.common_device_type import instantiate_device_type_tests
from torch.testing._internal.common_modules import ModuleErrorEnum, module_db, modules
from torch.testing._internal.common_utils import TestCase, run_tests
from torch.utils._pytree import tree_flatten, tree_map

_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def _cpu(x):
    return tree_map(lambda t: t.detach().cpu().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t, x)


class TestModulesOnDevice(TestCase):
    @modules(module_db, allowed_dtypes=_DTYPES)
    def test_matches_cpu(self, device, dtype, module_info, training):
        inputs = module_info.module_inputs_func(module_info, device=device, dtype=dtype, requires_grad=True,
                                                training=training)
        for i, mi in enumerate(inputs):
            if mi.forward_input is None:
                continue
            c = mi.constructor_input
            torch.manual_seed(0)
            m = module_info.module_cls(*c.args, **c.kwargs).to(device=device, dtype=dtype).train(training)
            if any(is_lazy(t) for t in (*m.parameters(), *m.buffers())):
                # No parameters to copy yet: the same constructor on CPU, from the same seed (they draw their
                # parameters in the first forward, from the same seed again).
                torch.manual_seed(0)
                ref = module_info.module_cls(*_cpu(c.args), **_cpu(c.kwargs)).to(dtype=dtype).train(training)
            else:
                ref = copy.deepcopy(m).to("cpu")
            args, kwargs = mi.forward_input.args, mi.forward_input.kwargs
            cargs, ckwargs = _cpu(args), _cpu(kwargs)
            torch.manual_seed(1)
            out = m(*args, **kwargs)
            torch.manual_seed(1)
            expected = ref(*cargs, **ckwargs)
            with self.subTest(sample=i, desc=mi.desc):
                self.assertEqual(out, expected, exact_device=False)
                outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
                if not outs:
                    continue
                refs = [t for t in tree_flatten(expected)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
                grads = [torch.ones_like(t) for t in outs]
                torch.autograd.backward(outs, grads)
                torch.autograd.backward(refs, [g.cpu() for g in grads])
                # Gradients of the inputs that are leaves on the device (their CPU copies are leaves too).
                pairs = [(t, c) for t, c in zip(tree_flatten((args, kwargs))[0], tree_flatten((cargs, ckwargs))[0])
                         if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf]
                self.assertEqual([t.grad for t, _ in pairs], [c.grad for _, c in pairs], exact_device=False)
                self.assertEqual([p.grad for p in m.parameters()], [p.grad for p in ref.parameters()],
                                 exact_device=False)

    @modules([m for m in module_db if m.module_error_inputs_func is not None], allowed_dtypes=(torch.float32,))
    def test_error_inputs(self, device, dtype, module_info, training):
        for ei in module_info.module_error_inputs_func(module_info, device=device, dtype=dtype,
                                                       requires_grad=False, training=training):
            mi = ei.module_error_input
            c = mi.constructor_input
            with self.assertRaisesRegex(ei.error_type, ei.error_regex):
                m = module_info.module_cls(*c.args, **c.kwargs)
                if ei.error_on == ModuleErrorEnum.FORWARD_ERROR:
                    m.to(device)(*mi.forward_input.args, **mi.forward_input.kwargs)


instantiate_device_type_tests(TestModulesOnDevice, globals())

if __name__ == "__main__":
    run_tests()
