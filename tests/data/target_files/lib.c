/* The library the target-file tests map: built twice, as victim.so (-DNAME=victim) and
 * impost.so (-DNAME=impost): the same code at the same offsets under other names, so a probe
 * that symbolized the file swapped in at the mapped path would name frames impost_*. */
#ifndef NAME
#define NAME victim
#endif
#define CAT2(a, b) a##_##b
#define CAT(a, b) CAT2(a, b)
#define FN(x) CAT(NAME, x)

volatile unsigned long sink;

__attribute__((noinline)) unsigned long FN(inner)(unsigned long n) {
    unsigned long x = 0;
    for (unsigned long i = 0; i < n; i++) x = x * 6364136223846793005ul + 1442695040888963407ul;
    sink = x;
    return x;
}

__attribute__((noinline)) unsigned long FN(spin)(unsigned long n) {
    unsigned long x = FN(inner)(n);
    sink += 1;
    return x;
}
