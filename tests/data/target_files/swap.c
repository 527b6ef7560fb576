/* The target of probe's target-file tests: a process that maps a file, then puts something else
 * at the file's path. Built by tests/target_files.rs with `cc -O2 -fomit-frame-pointer`. Prints
 * "ready PID", waits for a line on stdin, swaps, prints "swapped", then works until killed.
 *   swap LIB fifo           dlopen LIB; on go rename it to LIB.moved, mkfifo LIB; spin in LIB
 *   swap LIB elf OTHER      dlopen LIB; on go rename it to LIB.moved, rename OTHER to LIB; spin
 *   swap LIB deleted-fifo   dlopen LIB, unlink it and mkfifo "LIB (deleted)" (the name
 *                           /proc/PID/maps then shows) before "ready"; on go spin in LIB
 *   swap DATA data-fifo     map DATA (32 MiB, evicted, never touched); on go rename it to
 *                           DATA.moved, mkfifo DATA; sleep
 *   swap DATA data-hot      the same, but a new 32 MiB file, just written (resident), at DATA
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define DATA_BYTES (32ul << 20)

static void die(const char *what) {
    perror(what);
    exit(2);
}

static void moved(const char *path, char *out, size_t n) { snprintf(out, n, "%s.moved", path); }

static void write_file(const char *path, int evict) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) die("open");
    static char chunk[1 << 20];
    memset(chunk, 0xa5, sizeof chunk);
    for (unsigned long left = DATA_BYTES; left; left -= sizeof chunk)
        if (write(fd, chunk, sizeof chunk) != (ssize_t)sizeof chunk) die("write");
    if (fsync(fd)) die("fsync");
    if (evict && posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED)) die("fadvise");
    close(fd);
}

static void wait_go(void) {
    char line[16];
    printf("ready %d\n", getpid());
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin)) exit(2);
}

static void swapped(void) {
    printf("swapped\n");
    fflush(stdout);
}

int main(int argc, char **argv) {
    if (argc < 3) return 2;
    const char *path = argv[1], *mode = argv[2];
    char old[4096];
    moved(path, old, sizeof old);
    if (!strncmp(mode, "data-", 5)) {
        write_file(path, 1);
        int fd = open(path, O_RDONLY);
        if (fd < 0) die("open data");
        void *p = mmap(NULL, DATA_BYTES, PROT_READ, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) die("mmap");
        close(fd);
        wait_go();
        if (rename(path, old)) die("rename");
        if (!strcmp(mode, "data-fifo")) {
            if (mkfifo(path, 0644)) die("mkfifo");
        } else {
            write_file(path, 0);
        }
        swapped();
        for (;;) pause();
    }
    void *h = dlopen(path, RTLD_NOW);
    if (!h) {
        fprintf(stderr, "%s\n", dlerror());
        return 2;
    }
    unsigned long (*spin)(unsigned long) = (unsigned long (*)(unsigned long))dlsym(h, "victim_spin");
    if (!spin) return 2;
    if (!strcmp(mode, "deleted-fifo")) {
        char deleted[4200];
        snprintf(deleted, sizeof deleted, "%s (deleted)", path);
        if (unlink(path) || mkfifo(deleted, 0644)) die("deleted-fifo");
    }
    wait_go();
    if (!strcmp(mode, "fifo")) {
        if (rename(path, old) || mkfifo(path, 0644)) die("fifo");
    } else if (!strcmp(mode, "elf")) {
        if (argc < 4 || rename(path, old) || rename(argv[3], path)) die("elf");
    }
    swapped();
    for (;;) spin(1000000);
}
