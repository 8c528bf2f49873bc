"""Run an AOTInductor package with the GIL released: needed when the package calls collectives.

The stock runner keeps the GIL for the whole call. A graphc collective inside the package calls
back into Python and blocks in gloo, whose worker threads may need the GIL (to free a tensor),
which the blocked call path still holds: the ranks deadlock (docs/platform.md; seen here on the
first multi-rank step). Released around the call, the GIL is re-taken only by the callbacks that
need it. A tiny C++ extension, built once per host into torch's extension cache.
"""

from __future__ import annotations

import functools

_SOURCE = r"""
#include <torch/extension.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

struct GilFreeRunner {
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader;
  explicit GilFreeRunner(const std::string& path)
      : loader(std::make_unique<torch::inductor::AOTIModelPackageLoader>(path, "model", false, 1, -1)) {}
  std::vector<at::Tensor> run(std::vector<at::Tensor> inputs) {
    pybind11::gil_scoped_release release;
    return loader->boxed_run(std::move(inputs));
  }
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<GilFreeRunner>(m, "GilFreeRunner")
      .def(pybind11::init<const std::string&>())
      .def("run", &GilFreeRunner::run);
}
"""


@functools.cache
def _extension():
    from torch.utils.cpp_extension import load_inline

    return load_inline(name="graphc_gil_free_runner", cpp_sources=[_SOURCE], extra_cflags=["-O2"])


def gil_free_runner(path: str):
    """A callable (flat inputs) -> flat outputs running the package at `path` without the GIL."""
    return _extension().GilFreeRunner(path).run
