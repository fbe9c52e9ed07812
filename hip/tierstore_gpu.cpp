// tierstore's GPU shim: host-side runtime calls with a C ABI, so that the
// engine's aligned I/O buffers become DMA targets and bytes move
// device -> page-locked I/O buffer -> disk (and back) with no bounce copy.
//
// One source for AMD and NVIDIA: it is written against the HIP runtime API
// and ts_gpu_runtime.h maps those names to CUDA's when built with nvcc.
// Every function returns the runtime's error code (0 = success); handles
// (streams, events) travel as opaque pointers. The shim launches no kernels.
//
// Build: python -m tierstore.gpu build   (see hip/README.md)

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "ts_gpu_runtime.h"

#define TS_GPU_ABI 1

extern "C" {

// The C ABI's version: the Python loader refuses a library with another.
int ts_gpu_abi_version(void) { return TS_GPU_ABI; }

// "cuda" or "hip": the runtime this library was built against.
const char* ts_gpu_platform(void) { return TS_GPU_PLATFORM; }

const char* ts_gpu_error_string(int err) { return hipGetErrorString((hipError_t)err); }

const char* ts_gpu_error_name(int err) { return hipGetErrorName((hipError_t)err); }

int ts_gpu_runtime_version(int* version) { return (int)hipRuntimeGetVersion(version); }

int ts_gpu_driver_version(int* version) { return (int)hipDriverGetVersion(version); }

int ts_gpu_device_count(int* count) {
    int e = (int)hipGetDeviceCount(count);
    if (e != 0) {
        *count = 0;
        (void)hipGetLastError();  // not sticky: no device is an answer, not a failure
    }
    return e;
}

int ts_gpu_device_name(int device, char* buf, int len) { return (int)hipDeviceGetName(buf, len, device); }

int ts_gpu_get_device(int* device) { return (int)hipGetDevice(device); }

int ts_gpu_set_device(int device) { return (int)hipSetDevice(device); }

// Page-locks `nbytes` of existing host memory at `ptr` (for every device) so
// that asynchronous copies DMA straight into or out of it.
int ts_gpu_host_register(void* ptr, size_t nbytes) {
    return (int)hipHostRegister(ptr, nbytes, hipHostRegisterPortable);
}

int ts_gpu_host_unregister(void* ptr) { return (int)hipHostUnregister(ptr); }

// What the runtime knows of `ptr`: its memory type and device, or false
// for memory it does not know (the error is cleared, not sticky).
static bool pointer_attributes(const void* ptr, hipPointerAttribute_t* attr) {
    std::memset(attr, 0, sizeof(*attr));
    if (hipPointerGetAttributes(attr, ptr) != hipSuccess) {
        (void)hipGetLastError();
        return false;
    }
    return true;
}

// 1 if `ptr` is page-locked host memory the runtime knows, 0 if not (or on
// error): the check behind the copy-counting tests.
int ts_gpu_is_pinned(const void* ptr) {
    hipPointerAttribute_t attr;
    return pointer_attributes(ptr, &attr) && TS_GPU_PTR_TYPE(attr) == hipMemoryTypeHost ? 1 : 0;
}

// The device ordinal that owns `ptr`, or -1 for host or unknown memory.
int ts_gpu_pointer_device(const void* ptr, int* device) {
    hipPointerAttribute_t attr;
    bool known = pointer_attributes(ptr, &attr);
    *device = known && TS_GPU_PTR_TYPE(attr) == hipMemoryTypeDevice ? attr.device : -1;
    return 0;
}

// A non-blocking stream (it does not synchronise with the legacy default
// stream) at the lowest priority the device offers when `low_priority`, so
// that copies for checkpoints yield to training's own work.
int ts_gpu_stream_create(void** stream, int low_priority) {
    int least = 0, greatest = 0;
    int e = (int)hipDeviceGetStreamPriorityRange(&least, &greatest);
    if (e != 0) return e;
    hipStream_t s = nullptr;
    e = (int)hipStreamCreateWithPriority(&s, hipStreamNonBlocking, low_priority ? least : greatest);
    *stream = (void*)s;
    return e;
}

int ts_gpu_stream_destroy(void* stream) { return (int)hipStreamDestroy((hipStream_t)stream); }

int ts_gpu_stream_synchronize(void* stream) { return (int)hipStreamSynchronize((hipStream_t)stream); }

// Work queued on `stream` after this waits for `event` (recorded on any
// stream, e.g. the training framework's current one).
int ts_gpu_stream_wait_event(void* stream, void* event) {
    return (int)hipStreamWaitEvent((hipStream_t)stream, (hipEvent_t)event, 0);
}

// kind: 0 device -> host, 1 host -> device, 2 device -> device.
static int copy_kind(int kind, hipMemcpyKind* out) {
    switch (kind) {
        case 0: *out = hipMemcpyDeviceToHost; return 0;
        case 1: *out = hipMemcpyHostToDevice; return 0;
        case 2: *out = hipMemcpyDeviceToDevice; return 0;
        default: return (int)hipErrorInvalidValue;
    }
}

int ts_gpu_copy_async(void* dst, const void* src, size_t nbytes, int kind, void* stream) {
    hipMemcpyKind k;
    int e = copy_kind(kind, &k);
    if (e != 0) return e;
    return (int)hipMemcpyAsync(dst, src, nbytes, k, (hipStream_t)stream);
}

// `height` rows of `width` bytes, `spitch` apart at the source and `dpitch`
// apart at the destination: a column shard written straight into a strided
// device tensor (or read out of one) without a staging copy.
int ts_gpu_copy2d_async(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                        int kind, void* stream) {
    hipMemcpyKind k;
    int e = copy_kind(kind, &k);
    if (e != 0) return e;
    return (int)hipMemcpy2DAsync(dst, dpitch, src, spitch, width, height, k, (hipStream_t)stream);
}

// Events without timing (cheaper to record) unless `timing`.
int ts_gpu_event_create(void** event, int timing) {
    hipEvent_t ev = nullptr;
    int e = (int)hipEventCreateWithFlags(&ev, timing ? hipEventDefault : hipEventDisableTiming);
    *event = (void*)ev;
    return e;
}

int ts_gpu_event_destroy(void* event) { return (int)hipEventDestroy((hipEvent_t)event); }

int ts_gpu_event_record(void* event, void* stream) {
    return (int)hipEventRecord((hipEvent_t)event, (hipStream_t)stream);
}

// 0: done; 1: not yet; anything else: the runtime's error code.
int ts_gpu_event_query(void* event) {
    hipError_t e = hipEventQuery((hipEvent_t)event);
    if (e == hipSuccess) return 0;
    if (e == hipErrorNotReady) {
        (void)hipGetLastError();
        return 1;
    }
    return (int)e == 1 ? -1 : (int)e;
}

int ts_gpu_event_synchronize(void* event) { return (int)hipEventSynchronize((hipEvent_t)event); }

int ts_gpu_event_elapsed_ms(float* ms, void* start, void* end) {
    return (int)hipEventElapsedTime(ms, (hipEvent_t)start, (hipEvent_t)end);
}

}  // extern "C"
