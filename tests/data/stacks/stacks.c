/* Workloads with known call chains for probe's stack tests. Built by the tests with
 * `cc -O2 -fomit-frame-pointer`: no frame pointers, like real servers, so only .eh_frame
 * unwinding gives full stacks. Each mode prints "ready PID", waits for a line on stdin, works,
 * prints "done ...". Modes: spin SECS, read-cold FILE MIB, touch-cold FILE PAGES, churn THREADS,
 * bursts SECS (5 ms of work, 200 us asleep: the steal it measured while it ran).
 *   stacks spin SECONDS          outer -> middle -> inner, spinning in inner
 *   stacks deep SECONDS          a thread: big_frame (40 KiB of locals) -> by turns outer -> middle
 *                                -> inner and side -> inner, 250 ms each (llama-server's main is like it)
 *   stacks read-cold FILE MB     read_cold(): O_DIRECT reads of a file evicted from the cache
 *   stacks touch-cold FILE PAGES touch_cold(): touches PAGES pages of a cold file mapped MADV_RANDOM
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static volatile uint64_t sink;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + ts.tv_nsec;
}

static void wait_go(void) {
    char line[16];
    printf("ready %d\n", getpid());
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin)) exit(2);
}

__attribute__((noinline)) uint64_t inner(uint64_t deadline) {
    uint64_t x = 0;
    while (now_ns() < deadline)
        for (int i = 0; i < 100000; i++) x = x * 6364136223846793005ull + 1442695040888963407ull;
    sink = x;
    return x;
}

__attribute__((noinline)) uint64_t middle(uint64_t deadline) {
    uint64_t r = inner(deadline);
    sink += r;
    return r + 1;
}

__attribute__((noinline)) uint64_t outer(uint64_t deadline) {
    uint64_t r = middle(deadline);
    sink += r;
    return r + 1;
}

__attribute__((noinline)) uint64_t side(uint64_t deadline) {
    uint64_t r = inner(deadline);
    sink += r;
    return r + 2;
}

/* A frame with 40 KiB of locals over two call paths taken by turns. */
__attribute__((noinline)) uint64_t big_frame(double secs) {
    volatile char pad[40 << 10];
    /* Every page touched, as a program's locals are (an untouched page cannot be copied). */
    for (size_t i = 0; i < sizeof pad; i += 512) pad[i] = (char)i;
    pad[sizeof pad - 1] = 2;
    uint64_t end = now_ns() + (uint64_t)(secs * 1e9), r = 0;
    for (int turn = 0; now_ns() < end; turn++) {
        uint64_t slice = now_ns() + 250000000ull;
        r += turn % 2 ? side(slice < end ? slice : end) : outer(slice < end ? slice : end);
    }
    return r + pad[0] + pad[sizeof pad - 1];
}

/* The deep mode's thread (a thread's stack has room above its frames: the main thread's ends
 * a few KiB above main, nearer than the largest copy). */
static void *deep_thread(void *arg) {
    uint64_t r = big_frame(*(double *)arg);
    sink += r;
    return NULL;
}

static void make_cold(const char *path, size_t bytes) {
    int fd = open(path, O_RDWR | O_CREAT, 0644);
    if (fd < 0) { perror("open"); exit(2); }
    char *buf = malloc(1 << 20);
    memset(buf, 0xa5, 1 << 20);
    for (size_t done = 0; done < bytes; done += 1 << 20)
        if (write(fd, buf, 1 << 20) != 1 << 20) { perror("write"); exit(2); }
    fsync(fd);
    posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    close(fd);
    free(buf);
}

static uint64_t thread_cpu_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + ts.tv_nsec;
}

/* The thread's time waiting in a run queue, ns (/proc/thread-self/schedstat, second field). */
static uint64_t thread_runq_ns(void) {
    unsigned long long run = 0, wait = 0;
    FILE *f = fopen("/proc/thread-self/schedstat", "r");
    if (!f || fscanf(f, "%llu %llu", &run, &wait) != 2) { perror("schedstat"); exit(2); }
    fclose(f);
    return wait;
}

/* The machine's stolen time so far (/proc/stat's aggregate steal, USER_HZ ticks): a hypervisor
 * that runs something else on this vCPU while the thread runs takes wall time that is neither
 * the thread's CPU time nor its run-queue wait. */
static uint64_t steal_ticks(void) {
    unsigned long long v[8] = {0};
    FILE *f = fopen("/proc/stat", "r");
    if (!f || fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6], &v[7]) != 8) {
        perror("/proc/stat");
        exit(2);
    }
    fclose(f);
    return v[7];
}

/* The thread's voluntary context switches (/proc/thread-self/status): each time it blocked. */
static uint64_t thread_nvcsw(void) {
    char line[256];
    unsigned long long n = 0;
    FILE *f = fopen("/proc/thread-self/status", "r");
    if (!f) { perror("status"); exit(2); }
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "voluntary_ctxt_switches: %llu", &n) == 1) break;
    fclose(f);
    return n;
}

struct cold_read {
    uint64_t blocked_ns, steal_ticks, blocks;
};

/* The time the thread spent blocked while reading: wall time minus its CPU time and minus its
 * wait for a CPU after each wake-up (the kernel's run-queue count); with the machine's stolen
 * time over the same stretch (an upper bound of what of it was stolen from this thread) and how
 * many times the thread blocked. */
__attribute__((noinline)) struct cold_read read_cold(const char *path, size_t bytes) {
    int fd = open(path, O_RDONLY | O_DIRECT);
    if (fd < 0) { perror("open O_DIRECT"); exit(2); }
    void *buf;
    if (posix_memalign(&buf, 4096, 1 << 20)) exit(2);
    uint64_t s0 = steal_ticks(), v0 = thread_nvcsw();
    uint64_t t0 = now_ns(), c0 = thread_cpu_ns(), q0 = thread_runq_ns();
    for (size_t off = 0; off < bytes; off += 1 << 20)
        if (pread(fd, buf, 1 << 20, off) < 0) { perror("pread"); exit(2); }
    uint64_t wall = now_ns() - t0, cpu = thread_cpu_ns() - c0, runq = thread_runq_ns() - q0;
    struct cold_read r = {wall - cpu - runq, steal_ticks() - s0, thread_nvcsw() - v0};
    close(fd);
    free(buf);
    sink = wall;
    return r;
}

__attribute__((noinline)) uint64_t touch_cold(const char *path, size_t pages) {
    int fd = open(path, O_RDONLY);
    size_t len = pages * 16 * 4096;
    unsigned char *p = mmap(NULL, len, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) { perror("mmap"); exit(2); }
    madvise(p, len, MADV_RANDOM);
    uint64_t s = 0;
    for (size_t i = 0; i < pages; i++) s += ((volatile unsigned char *)p)[i * 16 * 4096];
    munmap(p, len);
    close(fd);
    sink = s;
    return s;
}

/* A thread that blocks once (off the CPU), then exits. */
static void *short_life(void *arg) {
    struct timespec ts = {0, 100000};
    nanosleep(&ts, NULL);
    return arg;
}

/* Blocks n times for 100 ms; returns the wall time it slept. */
__attribute__((noinline)) uint64_t churn_sleep(int n) {
    uint64_t t0 = now_ns();
    for (int i = 0; i < n; i++) {
        struct timespec ts = {0, 100000000};
        nanosleep(&ts, NULL);
    }
    return now_ns() - t0;
}

/* Bursts of 5 ms of work, 200 us asleep between them, for SECS: the hypervisor's steal while
 * the thread ran, as the thread measures it itself: each burst's wall time less its CPU time
 * (which leaves steal out) and less its run-queue wait. */
static void bursts(double secs) {
    uint64_t end = now_ns() + (uint64_t)(secs * 1e9), stolen = 0, s0 = steal_ticks(), n = 0;
    struct timespec nap = {0, 200000};
    while (now_ns() < end) {
        uint64_t q0 = thread_runq_ns(), c0 = thread_cpu_ns(), t0 = now_ns();
        inner(t0 + 5000000);
        uint64_t t1 = now_ns(), c1 = thread_cpu_ns(), q1 = thread_runq_ns();
        int64_t d = (int64_t)(t1 - t0) - (int64_t)(c1 - c0) - (int64_t)(q1 - q0);
        if (d > 0) stolen += (uint64_t)d;
        n++;
        nanosleep(&nap, NULL);
    }
    printf("done stolen_ns=%llu steal_ticks=%llu ticks_per_s=%ld tid=%d bursts=%llu\n", (unsigned long long)stolen,
           (unsigned long long)(steal_ticks() - s0), sysconf(_SC_CLK_TCK), (int)gettid(), (unsigned long long)n);
}

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: see the comment at the top\n"); return 2; }
    if (!strcmp(argv[1], "spin")) {
        wait_go();
        uint64_t r = outer(now_ns() + (uint64_t)(atof(argv[2]) * 1e9));
        printf("done %llu\n", (unsigned long long)(r & 1));
    } else if (!strcmp(argv[1], "deep")) {
        double secs = atof(argv[2]);
        pthread_t t;
        wait_go();
        if (pthread_create(&t, NULL, deep_thread, &secs)) { perror("pthread_create"); exit(2); }
        pthread_join(t, NULL);
        printf("done %llu\n", (unsigned long long)(sink & 1));
    } else if (!strcmp(argv[1], "read-cold") && argc > 3) {
        size_t bytes = (size_t)atoi(argv[3]) << 20;
        make_cold(argv[2], bytes);
        wait_go();
        struct cold_read r = read_cold(argv[2], bytes);
        printf("done blocked_ns=%llu steal_ticks=%llu blocks=%llu ticks_per_s=%ld\n", (unsigned long long)r.blocked_ns,
               (unsigned long long)r.steal_ticks, (unsigned long long)r.blocks, sysconf(_SC_CLK_TCK));
    } else if (!strcmp(argv[1], "touch-cold") && argc > 3) {
        size_t pages = (size_t)atoi(argv[3]);
        make_cold(argv[2], pages * 16 * 4096);
        wait_go();
        touch_cold(argv[2], pages);
        printf("done pages=%zu\n", pages);
    } else if (!strcmp(argv[1], "bursts")) {
        wait_go();
        bursts(atof(argv[2]));
    } else if (!strcmp(argv[1], "churn")) {
        /* Many short-lived threads, 64 at a time; then the main thread blocks. */
        int n = atoi(argv[2]);
        wait_go();
        for (int i = 0; i < n; i += 64) {
            pthread_t t[64];
            int k = n - i < 64 ? n - i : 64;
            for (int j = 0; j < k; j++)
                if (pthread_create(&t[j], NULL, short_life, NULL)) { perror("pthread_create"); exit(2); }
            for (int j = 0; j < k; j++) pthread_join(t[j], NULL);
        }
        uint64_t slept = churn_sleep(5);
        printf("done threads=%d slept_ns=%llu\n", n, (unsigned long long)slept);
    } else {
        return 2;
    }
    fflush(stdout);
    return 0;
}
