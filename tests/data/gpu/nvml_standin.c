/* A stand-in for libnvidia-ml (NVML), for machines without an NVIDIA GPU: probe loads it through
 * the same path as the driver's library (PROBE_NVML_LIB) and this one answers like a sleeping-
 * capable GPU would, writing every call with its CLOCK_MONOTONIC time to NVML_STANDIN_LOG, one
 * "ns name" line each, so a test can tell when probe held NVML open and what it asked.
 * Signatures follow nvml.h; every call succeeds (NVML_SUCCESS = 0). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int nvmlReturn_t;
typedef void *nvmlDevice_t;

static void note(const char *name) {
    const char *path = getenv("NVML_STANDIN_LOG");
    if (!path) return;
    FILE *f = fopen(path, "a");
    if (!f) return;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    fprintf(f, "%lld %s\n", (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec, name);
    fclose(f);
}

static int device_token;

static void copy(char *dst, unsigned int len, const char *src) {
    if (!dst || len == 0) return;
    strncpy(dst, src, len - 1);
    dst[len - 1] = 0;
}

nvmlReturn_t nvmlInit_v2(void) { note("nvmlInit_v2"); return 0; }
nvmlReturn_t nvmlInitWithFlags(unsigned int flags) { (void)flags; note("nvmlInitWithFlags"); return 0; }
nvmlReturn_t nvmlShutdown(void) { note("nvmlShutdown"); return 0; }
const char *nvmlErrorString(nvmlReturn_t r) { (void)r; return "stand-in"; }
nvmlReturn_t nvmlSystemGetDriverVersion(char *v, unsigned int len) { note("nvmlSystemGetDriverVersion"); copy(v, len, "550.54.14"); return 0; }
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *n) { note("nvmlDeviceGetCount_v2"); *n = 1; return 0; }
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_t *d) { (void)i; note("nvmlDeviceGetHandleByIndex_v2"); *d = &device_token; return 0; }
nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *n, unsigned int len) { (void)d; note("nvmlDeviceGetName"); copy(n, len, "Stand-in GPU"); return 0; }
nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *u, unsigned int len) { (void)d; note("nvmlDeviceGetUUID"); copy(u, len, "GPU-stand-in"); return 0; }
nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t d, int type, unsigned int *mhz) { (void)d; (void)type; note("nvmlDeviceGetMaxClockInfo"); *mhz = 1980; return 0; }
nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t d, int type, unsigned int *mhz) { (void)d; (void)type; note("nvmlDeviceGetClockInfo"); *mhz = 1500; return 0; }
nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t d, unsigned int *mw) { (void)d; note("nvmlDeviceGetEnforcedPowerLimit"); *mw = 300000; return 0; }
nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t d, unsigned int *mw) { (void)d; note("nvmlDeviceGetPowerUsage"); *mw = 60000; return 0; }
nvmlReturn_t nvmlDeviceGetPerformanceState(nvmlDevice_t d, int *p) { (void)d; note("nvmlDeviceGetPerformanceState"); *p = 0; return 0; }
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;
nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m) { (void)d; note("nvmlDeviceGetMemoryInfo"); m->total = 8ULL << 30; m->used = 1ULL << 30; m->free = m->total - m->used; return 0; }
nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m) { (void)d; note("nvmlDeviceGetMemoryInfo_v2"); m->total = 8ULL << 30; m->reserved = 0; m->used = 1ULL << 30; m->free = m->total - m->used; return 0; }
typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;
nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u) { (void)d; note("nvmlDeviceGetUtilizationRates"); u->gpu = 90; u->memory = 40; return 0; }
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *n, void *infos) { (void)d; (void)infos; note("nvmlDeviceGetComputeRunningProcesses_v3"); *n = 0; return 0; }
nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t d, unsigned int *n, void *infos) { (void)d; (void)infos; note("nvmlDeviceGetGraphicsRunningProcesses_v3"); *n = 0; return 0; }
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t d, unsigned int *n, void *infos) { (void)d; (void)infos; note("nvmlDeviceGetComputeRunningProcesses_v2"); *n = 0; return 0; }
nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t d, unsigned int *n, void *infos) { (void)d; (void)infos; note("nvmlDeviceGetGraphicsRunningProcesses_v2"); *n = 0; return 0; }
nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t d, unsigned long long *r) { (void)d; note("nvmlDeviceGetCurrentClocksThrottleReasons"); *r = 0; return 0; }
nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t d, unsigned long long *r) { (void)d; note("nvmlDeviceGetCurrentClocksEventReasons"); *r = 0; return 0; }
