/* Which x86 vendor this CPU is, for kernels whose fastest form differs between AMD and Intel cores with
 * the same instructions (measured, see the callers). The answer is asked once per library and cached. */
#ifndef TOKENMILL_CPU_VENDOR_H
#define TOKENMILL_CPU_VENDOR_H

/* 1 on an AMD CPU, 0 otherwise (other vendors, other architectures, compilers without the builtin). */
static int tm_cpu_is_amd(void) {
    static int answer = -1; /* -1: not asked yet; racing threads store the same value */
    int a = __atomic_load_n(&answer, __ATOMIC_RELAXED);
    if (a < 0) {
#if defined(__x86_64__) && defined(__GNUC__)
        __builtin_cpu_init();
        a = __builtin_cpu_is("amd") ? 1 : 0;
#else
        a = 0;
#endif
        __atomic_store_n(&answer, a, __ATOMIC_RELAXED);
    }
    return a;
}

/* A kernel's switch for a path it takes on AMD CPUs only: *mode is -1 (auto: by vendor), 0 (off) or 1 (on;
 * tests force each path through the kernel's exported setter). */
static inline int tm_amd_path_on(const int* mode) {
    const int m = __atomic_load_n(mode, __ATOMIC_RELAXED);
    return m < 0 ? tm_cpu_is_amd() : m;
}
static inline void tm_amd_path_set(int* mode, int value) {
    __atomic_store_n(mode, value < 0 ? -1 : value > 0, __ATOMIC_RELAXED);
}

#endif /* TOKENMILL_CPU_VENDOR_H */
