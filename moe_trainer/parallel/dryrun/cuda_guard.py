"""A CUDA device guard for a CPU-only torch build, so that autograd runs on fake CUDA tensors.

FakeTensorMode makes `device="cuda"` tensors without CUDA, but autograd asks the CUDA device guard
for a leaf's stream when it builds a gradient accumulator, and a CPU-only build registers none
("PyTorch is not linked with support for cuda devices", raised where it cannot be caught, and the
process aborts). `torch._C._ensureCUDADeviceGuardSet` registers nothing on this build. This
registers one, built once (about 30 s, cached under ~/.cache/torch_extensions): it tracks the
current device, reports `devices` devices, one default stream each, and events that are always
complete. A build that has CUDA keeps its own guard.
"""
from __future__ import annotations

import torch

_SOURCE = r"""
#include <torch/extension.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <ATen/detail/CUDAHooksInterface.h>

using namespace c10;

static DeviceIndex devices = 8;
static thread_local DeviceIndex current = 0;

struct FakeCudaGuard final : public impl::NoOpDeviceGuardImpl<DeviceType::CUDA> {
  Device exchangeDevice(Device d) const override { Device old(DeviceType::CUDA, current); setDevice(d); return old; }
  Device getDevice() const override { return Device(DeviceType::CUDA, current); }
  void setDevice(Device d) const override { if (d.has_index()) current = d.index(); }
  void uncheckedSetDevice(Device d) const noexcept override { if (d.has_index()) current = d.index(); }
  Stream getStream(Device d) const noexcept override {
    return Stream(Stream::DEFAULT, Device(DeviceType::CUDA, d.has_index() ? d.index() : current));
  }
  Stream getNewStream(Device d, int priority = 0) const override { return getStream(d); }
  Stream exchangeStream(Stream s) const noexcept override { return getStream(s.device()); }
  DeviceIndex deviceCount() const noexcept override { return devices; }
  void record(void** event, const Stream&, const DeviceIndex, const EventFlag) const override {}
  void block(void*, const Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const DeviceIndex) const override {}
};

// torch's accelerator must be CUDA: autograd gives a node a stream only when its device type is
// the accelerator's, and asserts both ends of every edge have one
namespace at { namespace detail {
// the registry's key is the class name getCUDAHooks() asks for
struct CUDAHooks final : public at::CUDAHooksInterface {
  CUDAHooks(at::CUDAHooksArgs) {}
  bool hasCUDA() const override { return true; }
  bool isAvailable() const override { return true; }
  bool isBuilt() const override { return true; }
  bool isPinnedPtr(const void*) const override { return false; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  DeviceIndex deviceCount() const override { return devices; }
  DeviceIndex getCurrentDevice() const override { return current; }
  int getNumGPUs() const override { return devices; }
  void init() const override {}
};
REGISTER_CUDA_HOOKS(CUDAHooks);
}}  // namespace at::detail

bool accelerator_is_cuda() {
  auto a = at::getAccelerator(false);
  return a.has_value() && *a == DeviceType::CUDA;
}

void install(int64_t n) {
  devices = static_cast<DeviceIndex>(n);
  // torch made its CUDA hooks (the CPU build's stand-in, CUDA absent) when it was imported, before
  // this library's registration could count: give that object this class's behaviour instead (the
  // same base and no members of its own, so only the virtual table differs)
  const at::CUDAHooksInterface& hooks = at::detail::getCUDAHooks();
  if (!hooks.hasCUDA()) {
    static at::detail::CUDAHooks mine{at::CUDAHooksArgs{}};
    *reinterpret_cast<void**>(const_cast<at::CUDAHooksInterface*>(&hooks)) = *reinterpret_cast<void**>(&mine);
  }
  static impl::DeviceGuardImplRegistrar registrar(DeviceType::CUDA, new FakeCudaGuard());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("install", &install); m.def("accelerator_is_cuda", &accelerator_is_cuda); }
"""

_INSTALLED: list = []


def install_cuda_guard(devices: int) -> None:
    """Register the guard for `devices` fake devices (before the first backward: autograd sizes
    its device threads by the count once)."""
    if _INSTALLED or torch.cuda._is_compiled():
        return
    from torch.utils.cpp_extension import load_inline
    module = load_inline("moe_trainer_fake_cuda_guard", cpp_sources=[_SOURCE], extra_cflags=["-O1"], verbose=False)
    module.install(max(8, devices))
    _INSTALLED.append(module)
