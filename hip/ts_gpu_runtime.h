// One spelling of the GPU runtime for tierstore's shim: the HIP names, mapped
// to CUDA's when the shim is built with nvcc (or any compiler without HIP).
// Only the host-side runtime API is used; the shim launches no kernels.
#pragma once

#if defined(TS_GPU_USE_HIP) || (defined(__HIPCC__) && !defined(TS_GPU_USE_CUDA))
#include <hip/hip_runtime_api.h>
#define TS_GPU_PLATFORM "hip"
// HIP 6 renamed the pointer attribute's memory type to CUDA's spelling.
#if defined(HIP_VERSION_MAJOR) && HIP_VERSION_MAJOR >= 6
#define TS_GPU_PTR_TYPE(attr) ((attr).type)
#else
#define TS_GPU_PTR_TYPE(attr) ((attr).memoryType)
#endif
#else
#include <cuda_runtime_api.h>
#define TS_GPU_PLATFORM "cuda"
#define TS_GPU_PTR_TYPE(attr) ((attr).type)

typedef cudaError_t hipError_t;
typedef cudaStream_t hipStream_t;
typedef cudaEvent_t hipEvent_t;
typedef cudaMemcpyKind hipMemcpyKind;
typedef cudaPointerAttributes hipPointerAttribute_t;

#define hipSuccess cudaSuccess
#define hipErrorNotReady cudaErrorNotReady
#define hipErrorInvalidValue cudaErrorInvalidValue
#define hipMemcpyHostToDevice cudaMemcpyHostToDevice
#define hipMemcpyDeviceToHost cudaMemcpyDeviceToHost
#define hipMemcpyDeviceToDevice cudaMemcpyDeviceToDevice
#define hipMemcpyDefault cudaMemcpyDefault
#define hipHostRegisterPortable cudaHostRegisterPortable
#define hipHostMallocPortable cudaHostAllocPortable
#define hipStreamNonBlocking cudaStreamNonBlocking
#define hipEventDisableTiming cudaEventDisableTiming
#define hipEventDefault cudaEventDefault
#define hipMemoryTypeDevice cudaMemoryTypeDevice
#define hipMemoryTypeHost cudaMemoryTypeHost

#define hipGetErrorString cudaGetErrorString
#define hipGetErrorName cudaGetErrorName
#define hipGetLastError cudaGetLastError
#define hipRuntimeGetVersion cudaRuntimeGetVersion
#define hipDriverGetVersion cudaDriverGetVersion
#define hipGetDeviceCount cudaGetDeviceCount
#define hipGetDevice cudaGetDevice
#define hipSetDevice cudaSetDevice
#define hipDeviceGetName(buf, len, dev) ts_cuda_device_name((buf), (len), (dev))
#define hipHostRegister cudaHostRegister
#define hipHostUnregister cudaHostUnregister
#define hipHostMalloc(p, n, f) cudaHostAlloc((p), (n), (f))
#define hipHostFree cudaFreeHost
#define hipStreamCreateWithPriority cudaStreamCreateWithPriority
#define hipDeviceGetStreamPriorityRange cudaDeviceGetStreamPriorityRange
#define hipStreamDestroy cudaStreamDestroy
#define hipStreamSynchronize cudaStreamSynchronize
#define hipStreamWaitEvent cudaStreamWaitEvent
#define hipMemcpyAsync cudaMemcpyAsync
#define hipMemcpy2DAsync cudaMemcpy2DAsync
#define hipEventCreateWithFlags cudaEventCreateWithFlags
#define hipEventDestroy cudaEventDestroy
#define hipEventRecord cudaEventRecord
#define hipEventQuery cudaEventQuery
#define hipEventSynchronize cudaEventSynchronize
#define hipEventElapsedTime cudaEventElapsedTime
#define hipPointerGetAttributes cudaPointerGetAttributes

#include <cstring>
// cudaGetDeviceProperties fills a large struct; the name is all the shim needs.
static inline cudaError_t ts_cuda_device_name(char* buf, int len, int dev) {
    cudaDeviceProp prop;
    cudaError_t e = cudaGetDeviceProperties(&prop, dev);
    if (e != cudaSuccess) return e;
    std::strncpy(buf, prop.name, (size_t)len);
    if (len > 0) buf[len - 1] = '\0';
    return cudaSuccess;
}
#endif
