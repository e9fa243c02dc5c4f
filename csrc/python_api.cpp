// The one translation unit that includes torch's op registry: every mok:: op's schema and its
// CUDA kernel registration. Fake (meta) implementations live next to each op's Python wrapper,
// named by set_python_module below.
//
// To add an op family: append one section to each of the two blocks below (schemas, then CUDA
// impls), in the same order, with the apis/ header it binds.
#include <Python.h>
#include <torch/library.h>

#include "apis/mxfp8.h"

// Importing mok_megatron._C runs the static registrations below; the module itself is empty.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}

TORCH_LIBRARY(mok, m) {
  // ---- mxfp8: csrc/apis/mxfp8.h; fakes in mok_megatron/ops/mxfp8.py ------------------------
  m.set_python_module("mok_megatron.ops.mxfp8");
  m.def("mxfp8_quantize(Tensor w, bool rowwise, bool colwise) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "mxfp8_quantize_out(Tensor w, bool rowwise, bool colwise, Tensor(a!) row_data, "
      "Tensor(b!) row_scales, Tensor(c!) col_data, Tensor(d!) col_scales) -> ()");
}

TORCH_LIBRARY_IMPL(mok, CUDA, m) {
  // ---- mxfp8 --------------------------------------------------------------------------------
  m.impl("mxfp8_quantize", &mok::apis::mxfp8_quantize);
  m.impl("mxfp8_quantize_out", &mok::apis::mxfp8_quantize_out);
}
