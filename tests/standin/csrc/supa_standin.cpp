// A stand-in for torch_br: the PrivateUse1 device `supa`, test-only.
//
// Memory lives on the host, but `supa` is a distinct device: its tensors come
// from this file's allocator (one capacity per device, so out-of-memory is
// real, and statistics move with every allocation), host<->device copies go
// through `_copy_from` (counted), and an op that mixes a `supa` and a `cpu`
// tensor raises as on a card. Every operator without a kernel here runs the
// CPU kernel on aliases of the same host memory (no copy of the inputs), and
// its fresh outputs are copied into `supa` memory.
//
// Modelled on PyTorch's OpenReg reference backend
// (test/cpp_extensions/open_registration_extension), smaller.

#include <torch/extension.h>

#include <ATen/CPUFunctions.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/NativeFunctions.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/core/GeneratorForPrivateuseone.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <ATen/native/transformers/attention.h>
#include <c10/core/Allocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <sched.h>

// OpenMP and MKL as torch links them (libgomp and the MKL in libtorch_cpu).
extern "C" int omp_get_max_threads(void);
extern "C" void omp_set_num_threads(int);
extern "C" int mkl_set_num_threads_local_(const int*);  // the by-reference entry: the only one libtorch_cpu exports reliably

namespace supa_standin {

using c10::Device;
using c10::DeviceIndex;
using c10::DeviceType;

constexpr int kMaxDevices = 64;

// ---- devices -------------------------------------------------------------

static int g_device_count = 8;
static thread_local DeviceIndex t_device = 0;

static void check_index(int64_t index) {
  TORCH_CHECK(
      index >= 0 && index < g_device_count,
      "invalid device ordinal supa:", index, " (", g_device_count,
      " stand-in devices)");
}

// ---- device memory: one capacity per device, statistics, OOM -------------

struct DeviceStats {
  int64_t capacity = int64_t(4) << 30;
  int64_t allocated = 0;
  int64_t peak = 0;
  int64_t num_allocs = 0;
  int64_t num_frees = 0;
  int64_t num_ooms = 0;
};

static std::mutex g_mem_mutex;
static bool g_poison = [] {
  const char* v = std::getenv("SUPA_STANDIN_POISON");
  return v == nullptr || std::string(v) != "0";
}();
static DeviceStats g_stats[kMaxDevices];

struct Block {
  void* ptr;
  int64_t bytes;
  DeviceIndex device;
};

static std::string human(int64_t bytes) {
  char buf[64];
  if (bytes >= (int64_t(1) << 30))
    snprintf(buf, sizeof buf, "%.2f GiB", bytes / double(int64_t(1) << 30));
  else
    snprintf(buf, sizeof buf, "%.2f MiB", bytes / double(1 << 20));
  return buf;
}

static void free_block(void* ctx) {
  auto* block = static_cast<Block*>(ctx);
  {
    std::lock_guard<std::mutex> lock(g_mem_mutex);
    auto& s = g_stats[block->device];
    s.allocated -= block->bytes;
    s.num_frees += 1;
  }
  std::free(block->ptr);
  delete block;
}

struct SupaAllocator final : c10::DeviceAllocator {
  c10::DataPtr allocate(size_t nbytes) override {
    const DeviceIndex device = t_device;
    const Device dev(DeviceType::PrivateUse1, device);
    if (nbytes == 0) return {nullptr, nullptr, &c10::detail::deleteNothing, dev};
    const int64_t bytes = int64_t((nbytes + 511) / 512 * 512);
    {
      std::lock_guard<std::mutex> lock(g_mem_mutex);
      auto& s = g_stats[device];
      if (s.allocated + bytes > s.capacity) {
        s.num_ooms += 1;
        TORCH_CHECK_WITH(
            OutOfMemoryError, false, "SUPA out of memory. Tried to allocate ",
            human(bytes), " on supa:", int(device), " (", human(s.capacity),
            " total, ", human(s.allocated), " already allocated)");
      }
      s.allocated += bytes;
      s.peak = std::max(s.peak, s.allocated);
      s.num_allocs += 1;
    }
    void* ptr = std::aligned_alloc(512, size_t(bytes));
    TORCH_CHECK(ptr != nullptr, "host allocation of ", human(bytes), " failed");
    // Device memory is not zeroed on a card: poison it (NaN in every float
    // dtype, -1 in integers) so a read of memory nothing wrote shows up.
    if (g_poison) std::memset(ptr, 0xFF, size_t(bytes));
    return {ptr, new Block{ptr, bytes, device}, &free_block, dev};
  }

  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  // torch.accelerator's memory API asks these.
  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t) override {}  // no cache: frees are immediate
  void recordStream(const c10::DataPtr&, c10::Stream) override {}
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(g_mem_mutex);
    const auto& s = g_stats[device];
    c10::CachingDeviceAllocator::DeviceStats out;
    for (auto* stat : {&out.allocated_bytes, &out.reserved_bytes, &out.active_bytes}) {
      (*stat)[0].current = s.allocated;
      (*stat)[0].peak = s.peak;
    }
    out.num_ooms = s.num_ooms;
    out.num_device_alloc = s.num_allocs;
    out.num_device_free = s.num_frees;
    return out;
  }
  void resetAccumulatedStats(DeviceIndex) override {}
  void resetPeakStats(DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(g_mem_mutex);
    g_stats[device].peak = g_stats[device].allocated;
  }
  std::pair<size_t, size_t> getMemoryInfo(DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(g_mem_mutex);
    const auto& s = g_stats[device];
    return {size_t(s.capacity - s.allocated), size_t(s.capacity)};
  }
};

static SupaAllocator g_allocator;
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &g_allocator);

// ---- pinned host memory --------------------------------------------------

static std::mutex g_pinned_mutex;
static std::map<uintptr_t, size_t> g_pinned;  // start -> bytes

static void free_pinned(void* ptr) {
  {
    std::lock_guard<std::mutex> lock(g_pinned_mutex);
    g_pinned.erase(reinterpret_cast<uintptr_t>(ptr));
  }
  std::free(ptr);
}

struct PinnedAllocator final : at::HostAllocator {
  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes == 0) return {nullptr, nullptr, &c10::detail::deleteNothing, Device(DeviceType::CPU)};
    void* ptr = std::aligned_alloc(64, (nbytes + 63) / 64 * 64);
    TORCH_CHECK(ptr != nullptr, "pinned host allocation failed");
    {
      std::lock_guard<std::mutex> lock(g_pinned_mutex);
      g_pinned[reinterpret_cast<uintptr_t>(ptr)] = nbytes;
    }
    return {ptr, ptr, &free_pinned, Device(DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
  // torch.accelerator's host-memory API asks these; no cache to manage.
  bool record_event(void*, void*, c10::Stream) override { return true; }
  void empty_cache() override {}
  at::HostStats get_stats() override { return {}; }
  void reset_accumulated_stats() override {}
  void reset_peak_stats() override {}
};

static PinnedAllocator g_pinned_allocator;
static bool g_host_allocator_registered = [] {
  at::setHostAllocator(at::kPrivateUse1, &g_pinned_allocator);
  return true;
}();

static bool is_pinned_ptr(const void* data) {
  const auto p = reinterpret_cast<uintptr_t>(data);
  std::lock_guard<std::mutex> lock(g_pinned_mutex);
  auto it = g_pinned.upper_bound(p);
  if (it == g_pinned.begin()) return false;
  --it;
  return p < it->first + std::max<size_t>(it->second, 1);
}

// ---- copy and fallback statistics ----------------------------------------

static std::mutex g_count_mutex;
static std::unordered_map<std::string, int64_t> g_counts;
static thread_local int t_internal = 0;  // >0: copies made by this file

static void count(const std::string& key, int64_t n = 1) {
  std::lock_guard<std::mutex> lock(g_count_mutex);
  g_counts[key] += n;
}

// ---- graph capture flag (the Python graph recorder sets it) ---------------

static std::atomic<bool> g_capturing{false};

static void check_not_capturing(const char* what) {
  TORCH_CHECK(
      !g_capturing.load(),
      what, ": operation not permitted when stream is capturing (a SUPA graph "
      "cannot synchronize with the host)");
}

// ---- generators: CPU generators that say they belong to supa:N ------------

struct SupaGeneratorImpl : public at::CPUGeneratorImpl {
  explicit SupaGeneratorImpl(DeviceIndex index)
      : at::CPUGeneratorImpl(c10::detail::getNonDeterministicRandom()),
        index_(index) {
    as_device();
  }
  // A CPU kernel checks that its generator is a CPU one: the fallback shows
  // it this generator as CPU for the duration of the call.
  void as_cpu() {
    device_ = Device(DeviceType::CPU);
    key_set_ = c10::DispatchKeySet(c10::DispatchKey::CPU);
  }
  void as_device() {
    device_ = Device(DeviceType::PrivateUse1, index_);
    key_set_ = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1);
  }
  DeviceIndex index_;
};

static std::once_flag g_gen_once;
static std::vector<at::Generator> g_default_generators;

static const at::Generator& default_generator(DeviceIndex index) {
  std::call_once(g_gen_once, [] {
    for (int i = 0; i < g_device_count; ++i)
      g_default_generators.push_back(at::make_generator<SupaGeneratorImpl>(DeviceIndex(i)));
  });
  const DeviceIndex i = index < 0 ? t_device : index;
  check_index(i);
  return g_default_generators[i];
}

// ---- device guard: the current device and stream are per thread -----------

static thread_local int64_t t_stream[kMaxDevices] = {0};
static std::atomic<int64_t> g_next_stream{1};

struct TimedEvent {
  std::chrono::steady_clock::time_point at;
};

struct SupaGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override { return DeviceType::PrivateUse1; }
  Device exchangeDevice(Device d) const override {
    Device old = getDevice();
    if (d.index() != old.index()) setDevice(d);
    return old;
  }
  Device getDevice() const override { return Device(DeviceType::PrivateUse1, t_device); }
  void setDevice(Device d) const override {
    TORCH_CHECK(d.is_privateuseone(), "expected a supa device, got ", d);
    check_index(d.index());
    t_device = d.index();
  }
  void uncheckedSetDevice(Device d) const noexcept override { t_device = d.index(); }
  c10::Stream getStream(Device d) const override {
    return c10::Stream(c10::Stream::UNSAFE, d, t_stream[d.index()]);
  }
  c10::Stream getDefaultStream(Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream getNewStream(Device d, int priority = 0) const override {
    return c10::Stream(c10::Stream::UNSAFE, d, g_next_stream++);
  }
  c10::Stream getStreamFromGlobalPool(Device d, bool = false) const override {
    return getNewStream(d);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    c10::Stream old = getStream(s.device());
    t_stream[s.device_index()] = s.id();
    return old;
  }
  DeviceIndex deviceCount() const noexcept override { return DeviceIndex(g_device_count); }
  // Work runs to completion when issued, so streams and events only keep
  // order and time.
  void record(void** event, const c10::Stream&, const DeviceIndex, const c10::EventFlag) const override {
    if (*event == nullptr) *event = new TimedEvent();
    static_cast<TimedEvent*>(*event)->at = std::chrono::steady_clock::now();
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void* event, const DeviceIndex) const noexcept override {
    delete static_cast<TimedEvent*>(event);
  }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const DeviceIndex) const override {}
  bool isStreamCapturing(const c10::Stream&) const override { return g_capturing.load(); }
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
  double elapsedTime(void* start, void* end, const DeviceIndex) const override {
    TORCH_CHECK(start && end, "both events must be recorded before elapsed_time");
    auto a = static_cast<TimedEvent*>(start)->at, b = static_cast<TimedEvent*>(end)->at;
    return std::chrono::duration<double, std::milli>(b - a).count();
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, SupaGuardImpl);

// ---- hooks: pinned memory, generators, availability ------------------------

struct SupaHooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  DeviceIndex deviceCount() const override { return DeviceIndex(g_device_count); }
  void setCurrentDevice(DeviceIndex d) const override { check_index(d); t_device = d; }
  DeviceIndex getCurrentDevice() const override { return t_device; }
  DeviceIndex exchangeDevice(DeviceIndex d) const override {
    auto old = t_device;
    setCurrentDevice(d);
    return old;
  }
  DeviceIndex maybeExchangeDevice(DeviceIndex d) const override { return exchangeDevice(d); }
  bool isPinnedPtr(const void* data) const override { return is_pinned_ptr(data); }
  at::Allocator* getPinnedMemoryAllocator() const override { return &g_pinned_allocator; }
  const at::Generator& getDefaultGenerator(DeviceIndex index) const override {
    return default_generator(index);
  }
  at::Generator getNewGenerator(DeviceIndex index) const override {
    return at::make_generator<SupaGeneratorImpl>(index < 0 ? t_device : index);
  }
  Device getDeviceFromPtr(void*) const override { return Device(DeviceType::PrivateUse1, t_device); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    at::native::resize_bytes_cpu(storage.unsafeGetStorageImpl(), newsize);
  }
};

static bool g_hooks_registered = [] {
  at::RegisterPrivateUse1HooksInterface(new SupaHooks());
  return true;
}();

// ---- aliases: a supa tensor seen as a CPU tensor on the same memory --------

static at::Tensor cpu_alias(const at::Tensor& t) {
  auto options = t.options().device(at::kCPU);
  if (t.numel() == 0 || t.data_ptr() == nullptr)
    return at::empty_strided(t.sizes(), t.strides(), options);
  at::Tensor keep = t;  // the alias keeps the supa storage alive
  return at::from_blob(
      t.data_ptr(), t.sizes(), t.strides(), [keep](void*) mutable { keep.reset(); },
      options);
}

// A fresh CPU result copied into supa memory (not counted as a user copy).
static at::Tensor to_device(const at::Tensor& cpu, Device device) {
  c10::DeviceGuard guard(device);
  auto options = cpu.options().device(device);
  at::Tensor out = cpu.is_non_overlapping_and_dense()
      ? at::empty_strided(cpu.sizes(), cpu.strides(), options)
      : at::empty(cpu.sizes(), options);
  if (out.numel() > 0) cpu_alias(out).copy_(cpu);
  return out;
}

// ---- kernels every backend registers ---------------------------------------

static at::Tensor empty_memory_format(
    c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
    std::optional<c10::Layout> layout, std::optional<Device> device,
    std::optional<bool> pin_memory, std::optional<c10::MemoryFormat> memory_format) {
  const auto dev = c10::device_or_default(device);
  TORCH_CHECK(dev.is_privateuseone(), "expected a supa device");
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided, "supa tensors are strided");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory), "only CPU memory can be pinned");
  c10::DeviceGuard guard(dev);
  return at::detail::empty_generic(
      size, &g_allocator, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      c10::dtype_or_default(dtype), memory_format);
}

static at::Tensor empty_strided(
    c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<c10::ScalarType> dtype,
    std::optional<c10::Layout> layout, std::optional<Device> device,
    std::optional<bool> pin_memory) {
  const auto dev = c10::device_or_default(device);
  TORCH_CHECK(dev.is_privateuseone(), "expected a supa device");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory), "only CPU memory can be pinned");
  c10::DeviceGuard guard(dev);
  return at::detail::empty_strided_generic(
      size, stride, &g_allocator, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      c10::dtype_or_default(dtype));
}

static at::Tensor as_strided(
    const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
    std::optional<c10::SymInt> storage_offset) {
  return at::cpu::as_strided_symint(self, size, stride, std::move(storage_offset));
}

static const at::Tensor& resize_(
    const at::Tensor& self, c10::SymIntArrayRef size,
    std::optional<at::MemoryFormat> memory_format) {
  c10::DeviceGuard guard(self.device());
  return at::native::resize_(self, C10_AS_INTARRAYREF_SLOW(size), memory_format);
}

static at::Tensor reshape_alias(
    const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  return at::native::_reshape_alias(
      self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride));
}

static at::Tensor view(const at::Tensor& self, c10::SymIntArrayRef size) {
  return at::native::view(self, C10_AS_INTARRAYREF_SLOW(size));
}

static at::Tensor unfold(const at::Tensor& self, int64_t dim, int64_t size, int64_t step) {
  return at::native::unfold(self, dim, size, step);
}

static at::Tensor view_as_real(const at::Tensor& self) { return at::native::view_as_real(self); }
static at::Tensor view_as_complex(const at::Tensor& self) { return at::native::view_as_complex(self); }

// Host<->device and device<->device copies: the one place data crosses.
static at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  const bool src_dev = self.device().is_privateuseone();
  const bool dst_dev = dst.device().is_privateuseone();
  if (t_internal == 0) {
    const int64_t bytes = self.numel() * self.element_size();
    if (src_dev && dst_dev) {
      count("copy.d2d");
      count("copy.d2d_bytes", bytes);
    } else if (dst_dev) {
      count("copy.h2d");
      count("copy.h2d_bytes", bytes);
      if (non_blocking && self.is_pinned()) count("copy.h2d_pinned_non_blocking");
    } else {
      if (!non_blocking) check_not_capturing("copy to the host");
      count("copy.d2h");
      count("copy.d2h_bytes", bytes);
      if (non_blocking && dst.is_pinned()) count("copy.d2h_pinned_non_blocking");
    }
  }
  at::Tensor dst_cpu = dst_dev ? cpu_alias(dst) : dst;
  at::Tensor src_cpu = src_dev ? cpu_alias(self) : self;
  if (dst.numel() > 0) dst_cpu.copy_(src_cpu);
  return dst;
}

static at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  {
    c10::DeviceGuard guard(dst.device());
    at::native::resize_(dst, self.sizes(), std::nullopt);
  }
  return copy_from(self, dst, false);
}

static at::Scalar local_scalar_dense(const at::Tensor& self) {
  check_not_capturing("Tensor.item()");
  if (t_internal == 0) count("copy.item");
  return at::_local_scalar_dense(cpu_alias(self));
}

static at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& source) {
  return at::native::set_tensor_(self, source);
}
static at::Tensor& set_source_storage(at::Tensor& self, at::Storage source) {
  return at::native::set_(self, source);
}
static at::Tensor& set_source_storage_offset(
    at::Tensor& self, at::Storage source, c10::SymInt offset, c10::SymIntArrayRef size,
    c10::SymIntArrayRef stride) {
  return at::cpu::set_(
      self, source, offset.expect_int(), C10_AS_INTARRAYREF_SLOW(size),
      C10_AS_INTARRAYREF_SLOW(stride));
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", as_strided);
  m.impl("resize_", resize_);
  m.impl("_reshape_alias", reshape_alias);
  m.impl("view", view);
  m.impl("unfold", unfold);
  m.impl("view_as_real", view_as_real);
  m.impl("view_as_complex", view_as_complex);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("_local_scalar_dense", local_scalar_dense);
  m.impl("set_.source_Tensor", set_source_tensor);
  m.impl("set_.source_Storage", set_source_storage);
  m.impl("set_.source_Storage_storage_offset", set_source_storage_offset);
}

// ---- the device's own cores ------------------------------------------------
//
// A card computes with its own cores however many host threads torch has,
// and vLLM drops torch to one host thread for serving (on a card host threads
// only schedule work). The stand-in's device computes on the host, so its
// kernels run with the device's threads: SUPA_STANDIN_THREADS, else
// OMP_NUM_THREADS as the process got it (vLLM gives each multi-process worker
// its share of the host that way), else every core this process may use.

static int device_threads() {
  static const int n = [] {
    for (const char* var : {"SUPA_STANDIN_THREADS", "OMP_NUM_THREADS"}) {
      const char* v = std::getenv(var);
      if (v != nullptr && std::atoi(v) > 0) return std::atoi(v);
    }
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
    return 1;
  }();
  return n;
}

struct DeviceThreads {
  int host_omp = 0;
  int host_mkl = 0;
  bool changed = false;
  DeviceThreads() {
    host_omp = omp_get_max_threads();
    changed = host_omp != device_threads();
    if (!changed) return;
    omp_set_num_threads(device_threads());
    const int n = device_threads();
    host_mkl = mkl_set_num_threads_local_(&n);
  }
  ~DeviceThreads() {
    if (!changed) return;
    omp_set_num_threads(host_omp);
    mkl_set_num_threads_local_(&host_mkl);
  }
};

// ---- the fallback: CPU kernels on aliases ---------------------------------

// Ops a card also accepts with a CPU index or scalar operand.
static bool allows_cpu_operands(const std::string& name) {
  return name == "aten::index" || name == "aten::index_put_" ||
      name == "aten::_index_put_impl_" || name == "aten::index_put";
}

struct Visitor {
  std::optional<Device> device;
  std::optional<Device> other;
  void operator()(const at::Tensor& t) {
    if (!t.defined()) return;
    // A 0-dim CPU tensor is a scalar operand, which a card takes too.
    if (t.device().is_cpu() && t.dim() == 0) return;
    if (!device) {
      if (t.device().is_privateuseone()) device = t.device();
      else if (!other) other = t.device();
      return;
    }
    if (t.device() != *device && !other) other = t.device();
  }
};

template <typename F>
static void for_each_tensor(const c10::IValue& v, F&& f) {
  if (v.isTensor()) {
    f(v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorVector()) f(t);
  } else if (v.isList()) {
    for (const c10::IValue& e : v.toListRef())
      if (e.isTensor()) f(e.toTensor());
  }
}

static c10::IValue map_tensors(const c10::IValue& v, const std::function<at::Tensor(const at::Tensor&)>& f) {
  if (v.isTensor()) return f(v.toTensor());
  if (v.isTensorList()) {
    std::vector<at::Tensor> out;
    for (const at::Tensor& t : v.toTensorVector()) out.push_back(f(t));
    return c10::IValue(out);
  }
  if (v.isList()) {
    auto list = v.toList();
    auto copy = list.copy();
    for (size_t i = 0; i < copy.size(); ++i) {
      c10::IValue e = copy.get(i);
      if (e.isTensor()) copy.set(i, f(e.toTensor()));
    }
    return copy;
  }
  return v;
}

struct GeneratorsAsCpu {
  std::vector<SupaGeneratorImpl*> impls;
  void add(const at::Generator& g) {
    if (!g.defined() || !g.device().is_privateuseone()) return;
    auto* impl = dynamic_cast<SupaGeneratorImpl*>(g.unsafeGetGeneratorImpl());
    if (impl == nullptr) return;
    impl->as_cpu();
    impls.push_back(impl);
  }
  ~GeneratorsAsCpu() {
    for (auto* impl : impls) impl->as_device();
  }
};

static void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const std::string& name = schema.name();
  const size_t nargs = schema.arguments().size();
  const size_t begin = stack->size() - nargs;

  Visitor visit;
  for (size_t i = 0; i < nargs; ++i) for_each_tensor((*stack)[begin + i], visit);
  TORCH_CHECK(visit.device.has_value(), name, ": the supa fallback was reached without a supa tensor");
  if (visit.other && !allows_cpu_operands(name)) {
    TORCH_CHECK(
        false, "Expected all tensors to be on the same device, but found at least two "
        "devices, ", *visit.device, " and ", *visit.other, "! (when checking arguments for ",
        name, ")");
  }
  for (const auto& ret : schema.returns()) {
    const auto* alias = ret.alias_info();
    TORCH_CHECK(
        alias == nullptr || alias->isWrite(), name,
        " returns a view and has no supa kernel in the stand-in; register one in "
        "tests/standin/csrc/supa_standin.cpp");
  }
  count("op." + name);
  const Device device = *visit.device;
  t_internal += 1;
  struct Exit { ~Exit() { t_internal -= 1; } } exit_guard;

  GeneratorsAsCpu generators;
  for (size_t i = 0; i < nargs; ++i) {
    const auto& arg = schema.arguments()[i];
    c10::IValue& v = (*stack)[begin + i];
    if (arg.name() != "generator") continue;
    if (v.isNone()) v = c10::IValue(default_generator(device.index()));
    if (v.isGenerator()) generators.add(v.toGenerator());
  }

  bool has_out = false;
  for (const auto& arg : schema.arguments()) has_out = has_out || arg.is_out();
  if (has_out) {
    // An out= variant may resize its outputs: let PyTorch's own fallback copy
    // them to the host and back.
    DeviceThreads threads;
    at::native::cpu_fallback(op, stack);
    return;
  }

  std::vector<std::pair<at::TensorImpl*, at::Tensor>> aliases;  // alias -> supa
  auto to_alias = [&](const at::Tensor& t) -> at::Tensor {
    if (!t.defined() || !t.device().is_privateuseone()) return t;
    at::Tensor a = cpu_alias(t);
    aliases.emplace_back(a.unsafeGetTensorImpl(), t);
    return a;
  };
  for (size_t i = 0; i < nargs; ++i) (*stack)[begin + i] = map_tensors((*stack)[begin + i], to_alias);

  {
    DeviceThreads threads;
    op.callBoxed(stack);
  }

  auto back = [&](const at::Tensor& t) -> at::Tensor {
    if (!t.defined() || !t.device().is_cpu()) return t;
    for (const auto& [impl, original] : aliases)
      if (impl == t.unsafeGetTensorImpl()) return original;  // in place: self
    return to_device(t, device);
  };
  const size_t nret = schema.returns().size();
  for (size_t i = stack->size() - nret; i < stack->size(); ++i)
    (*stack)[i] = map_tensors((*stack)[i], back);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

// ---- fused attention: SDPA as torch_br gives it on a card -----------------
//
// Without a choice registered for the device, scaled_dot_product_attention
// takes the math path: matmul, softmax and matmul through the fallback, one
// op at a time (9x slower than CPU's flash kernel on a prefill shape). A
// card's torch_br serves SDPA with its own fused kernel; here that is CPU's.

static int64_t fused_sdp_choice(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
    std::optional<double> scale, bool enable_gqa) {
  const bool fused = dropout_p == 0.0 && !enable_gqa && query.dim() == 4 &&
      query.size(1) == key.size(1) && !query.requires_grad() &&
      !key.requires_grad() && !value.requires_grad();
  count(fused ? "sdpa.fused" : "sdpa.math");
  return static_cast<int64_t>(fused ? at::SDPBackend::overrideable : at::SDPBackend::math);
}

static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, c10::SymInt, c10::SymInt,
                  at::Tensor, at::Tensor, at::Tensor>
fused_attention(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& attn_bias, double dropout_p, bool is_causal,
    bool return_debug_mask, std::optional<double> scale) {
  const Device device = query.device();
  std::optional<at::Tensor> mask;
  if (attn_bias.has_value() && attn_bias->defined()) mask = cpu_alias(*attn_bias);
  DeviceThreads threads;
  auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(
      cpu_alias(query), cpu_alias(key), cpu_alias(value), dropout_p, is_causal, mask, scale);
  auto none = at::empty({0}, query.options());
  return {to_device(out, device), to_device(lse, device), none, none,
          c10::SymInt(query.size(2)), c10::SymInt(key.size(2)), none, none, none};
}

}  // namespace supa_standin
namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &supa_standin::fused_sdp_choice)
}  // namespace at::native
namespace supa_standin {

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_scaled_dot_product_fused_attention_overrideable", fused_attention);
}

// ---- Python API (torch_br._C) ---------------------------------------------

static void configure(int device_count, int64_t capacity_bytes) {
  TORCH_CHECK(device_count > 0 && device_count <= kMaxDevices, "device count out of range");
  std::lock_guard<std::mutex> lock(g_mem_mutex);
  g_device_count = device_count;
  for (auto& s : g_stats) s.capacity = capacity_bytes;
}

static std::unordered_map<std::string, int64_t> memory_stats(int64_t device) {
  check_index(device);
  std::lock_guard<std::mutex> lock(g_mem_mutex);
  const auto& s = g_stats[device];
  return {
      {"allocated_bytes.all.current", s.allocated},
      {"allocated_bytes.all.peak", s.peak},
      {"reserved_bytes.all.current", s.allocated},
      {"reserved_bytes.all.peak", s.peak},
      {"allocation.all.allocated", s.num_allocs},
      {"allocation.all.freed", s.num_frees},
      {"num_ooms", s.num_ooms},
      {"capacity_bytes", s.capacity},
  };
}

static void reset_peak(int64_t device) {
  check_index(device);
  std::lock_guard<std::mutex> lock(g_mem_mutex);
  g_stats[device].peak = g_stats[device].allocated;
}

static void manual_seed(int64_t device, uint64_t seed) {
  auto gen = default_generator(DeviceIndex(device));
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_current_seed(seed);
}

static uint64_t initial_seed(int64_t device) {
  return default_generator(DeviceIndex(device)).current_seed();
}

static std::unordered_map<std::string, int64_t> counts() {
  std::lock_guard<std::mutex> lock(g_count_mutex);
  return g_counts;
}

static void reset_counts() {
  std::lock_guard<std::mutex> lock(g_count_mutex);
  g_counts.clear();
}

// The intra-op threads a device kernel sees (the fallback's guard).
static int kernel_threads() {
  DeviceThreads threads;
  return at::get_num_threads();
}

}  // namespace supa_standin

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace supa_standin;
  m.def("configure", &configure, "device count and per-device capacity in bytes");
  m.def("device_count", [] { return g_device_count; });
  m.def("current_device", [] { return int(t_device); });
  m.def("set_device", [](int64_t i) { check_index(i); t_device = DeviceIndex(i); });
  m.def("memory_stats", &memory_stats);
  m.def("device_threads", &device_threads);
  m.def("kernel_threads", &kernel_threads);
  m.def("reset_peak_memory_stats", &reset_peak);
  m.def("manual_seed", &manual_seed);
  m.def("initial_seed", &initial_seed);
  m.def("set_capturing", [](bool on) { g_capturing.store(on); });
  m.def("is_capturing", [] { return g_capturing.load(); });
  m.def("counts", &counts, "copy and fallback counters");
  m.def("reset_counts", &reset_counts);
}
