/* Constants of the float32 exp shared by the SiLU and decode-attention kernels: Cody-Waite range
 * reduction x = n ln2 + r (ln2 split into a high part exact in float and a low correction) and a
 * degree-6 polynomial exp(r) ~ 1 + r + r^2/2! + ... + r^6/6! for |r| <= ln2/2. Each kernel writes
 * its own clamp and 2^n scaling per ISA path with these. */
#ifndef TOKENMILL_EXP_POLY_H
#define TOKENMILL_EXP_POLY_H

#define EXP_C2 0.5f
#define EXP_C3 0.16666667f
#define EXP_C4 0.041666668f
#define EXP_C5 0.008333334f
#define EXP_C6 0.0013888889f
#define LN2_HI 0.693145751953125f
#define LN2_LO 1.42860682030941723212e-6f
#define LOG2E 1.44269504088896341f

#endif /* TOKENMILL_EXP_POLY_H */
