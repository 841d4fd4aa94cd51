// The part of every `aoti` executable that is the same for all ops (compiler/_runtime.py builds it once
// per host and fingerprint, after AOTInductor's `interface.cpp` and `NeuronOpInfo`, the struct units
// define their info with (compiler/_units.py OP_INFO), which the build prepends to this file).
//
// AOTInductor's runtime (the model container and its C interface, which AOTInductor's runner calls)
// drives one model class, `AOTInductorModel`, whose constructor and `run_impl` AOTInductor generates per
// model. Here they are defined once, forwarding to two C entry points each op's unit provides
// (compiler/_units.py): `neuron_op_info` (inputs, outputs, their names and pytree specs) and
// `neuron_op_run` (the generated `run_impl` body). Both are hidden: an op's .so resolves them to its own
// unit (the link's `--defsym` picks the unit of a batch), never to another .so's.

extern "C" __attribute__((visibility("hidden"))) const NeuronOpInfo* neuron_op_info();
extern "C" __attribute__((visibility("hidden"))) void neuron_op_run(
    AtenTensorHandle* input_handles, AtenTensorHandle* output_handles, int32_t device_idx,
    AOTIProxyExecutorHandle proxy_executor);

// No op carries constants (units refuse graphs with constants): the empty blob model_base.h expects, as
// AOTInductor writes it for a model without constants.
asm(".section .lrodata,\"a\"\n"
    ".balign 64\n"
    ".globl _binary_constants_bin_start\n.hidden _binary_constants_bin_start\n_binary_constants_bin_start:\n"
    ".globl _binary_constants_bin_end\n.hidden _binary_constants_bin_end\n_binary_constants_bin_end:\n"
    ".text\n");

namespace torch::aot_inductor {

AOTInductorModel::AOTInductorModel(std::shared_ptr<ConstantMap> constants_map,
                                   std::shared_ptr<std::vector<ConstantHandle>> constants_array,
                                   const std::string& device_str,
                                   std::optional<std::string> cubin_dir)
    : AOTInductorModelBase(neuron_op_info()->n_inputs, neuron_op_info()->n_outputs, 0, device_str,
                           std::move(cubin_dir), true) {
  const NeuronOpInfo* info = neuron_op_info();
  for (long i = 0; i < info->n_inputs; ++i) inputs_info_[i].name = info->in_names[i];
  for (long i = 0; i < info->n_outputs; ++i) outputs_info_[i].name = info->out_names[i];
  update_constants_map(std::move(constants_map));
  update_constants_array(std::move(constants_array));
  in_spec_ = info->in_spec;
  out_spec_ = info->out_spec;
}

std::unordered_map<std::string, AtenTensorHandle> AOTInductorModel::const_run_impl(
    DeviceStreamType, AOTIProxyExecutorHandle, bool initialization) {
  if (!initialization) {
    std::cerr << "[WARNING] Calling constant_folding in model, but compiled with config: "
              << "aot_inductor.use_runtime_constant_folding=False\n";
  }
  return {};
}

void AOTInductorModel::_const_run_impl(std::vector<AtenTensorHandle>&, DeviceStreamType, AOTIProxyExecutorHandle) {}

void AOTInductorModel::run_impl(AtenTensorHandle* input_handles, AtenTensorHandle* output_handles,
                                DeviceStreamType, AOTIProxyExecutorHandle proxy_executor) {
  neuron_op_run(input_handles, output_handles, device_idx_, proxy_executor);
}

}  // namespace torch::aot_inductor
