/* isa_peak: instructions per cycle of the integer GEMV's arithmetic on this CPU, each over
 * 12 independent register chains (so throughput, not latency, bounds), per cycle of the
 * clock a dependent chain of scalar adds measures (one add per cycle). What bounds
 * gemv_int.c at 8 input rows (docs/measurements.md):
 *
 *     gcc -O3 -march=native tools/isa_peak.c -o /tmp/isa_peak && /tmp/isa_peak
 *
 * CPU time of the calling thread, least of 3 runs. The AVX-512 rows need AVX512-VNNI; the
 * ymm rows (AVX2's GEMV and attention arithmetic: vpmaddwd, FMA, the byte widening) run on
 * any AVX2 CPU. */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t);return t.tv_sec+1e-9*t.tv_nsec;}
#define R12(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11)
#define BENCH(NAME, T, INIT, OP) { \
  T a0=INIT,a1=INIT,a2=INIT,a3=INIT,a4=INIT,a5=INIT,a6=INIT,a7=INIT,a8=INIT,a9=INIT,a10=INIT,a11=INIT; double best=1e9; \
  for(int rep=0;rep<3;rep++){ double t0=now(); for(long k=0;k<n;k++){ \
    a0=OP(a0);a1=OP(a1);a2=OP(a2);a3=OP(a3);a4=OP(a4);a5=OP(a5);a6=OP(a6);a7=OP(a7);a8=OP(a8);a9=OP(a9);a10=OP(a10);a11=OP(a11); \
    __asm__ volatile("" : "+v"(a0),"+v"(a1),"+v"(a2),"+v"(a3),"+v"(a4),"+v"(a5),"+v"(a6),"+v"(a7),"+v"(a8),"+v"(a9),"+v"(a10),"+v"(a11)); } \
  double t=now()-t0; if(t<best)best=t;} printf("%-22s %.2f per cycle\n", NAME, 12.0*n/best/ghz/1e9); }
int main(void){
  const long n=10000000; double ghz, bc=1e9;
  for(int rep=0;rep<3;rep++){ long v=0; double t0=now(); for(long k=0;k<12*n;k++) __asm__ volatile("add $1, %0" : "+r"(v)); double t=now()-t0; if(t<bc)bc=t; }
  ghz = 12.0*n/bc/1e9; printf("clock %.2f GHz\n", ghz);
#if defined(__AVX512VNNI__)
  __m512i w=_mm512_set1_epi16(3), x=_mm512_set1_epi16(5); __m256i w2=_mm256_set1_epi16(3), x2=_mm256_set1_epi16(5);
  __m512 f=_mm512_set1_ps(1.0001f);
#define DPW(a) _mm512_dpwssd_epi32(a,w,x)
#define DPB(a) _mm512_dpbusd_epi32(a,w,x)
#define DPWY(a) _mm256_dpwssd_epi32(a,w2,x2)
#define FMA(a) _mm512_fmadd_ps(a,f,f)
#define ADD(a) _mm512_add_epi32(a,w)
  BENCH("dpwssd zmm", __m512i, _mm512_set1_epi32(1), DPW)
  BENCH("dpbusd zmm", __m512i, _mm512_set1_epi32(1), DPB)
  BENCH("dpwssd ymm", __m256i, _mm256_set1_epi32(1), DPWY)
  BENCH("fma zmm", __m512, _mm512_set1_ps(1), FMA)
  BENCH("add_epi32 zmm", __m512i, _mm512_set1_epi32(1), ADD)
#endif
  __m256i wy=_mm256_set1_epi16(3); __m256 fy=_mm256_set1_ps(1.0001f);
#define MADDY(a) _mm256_madd_epi16(a,wy)
#define FMAY(a) _mm256_fmadd_ps(a,fy,fy)
#define ADDY(a) _mm256_add_epi32(a,wy)
#define ZXY(a) _mm256_cvtepu8_epi16(_mm256_castsi256_si128(a))
  BENCH("vpmaddwd ymm", __m256i, wy, MADDY)
  BENCH("fma ymm", __m256, fy, FMAY)
  BENCH("add_epi32 ymm", __m256i, wy, ADDY)
  BENCH("vpmovzxbw ymm", __m256i, wy, ZXY)
  return 0;
}
