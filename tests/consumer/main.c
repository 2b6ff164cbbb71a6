/* Uses the installed header and library: checks the version and builds a small layout. */
#include <hsap/hsap.h>
#include <stdio.h>

int main(void) {
  const int64_t cu_seqlens[3] = {0, 3, 7};
  hsapLayout_t layout = NULL;
  int64_t pairs = 0;
  int version = 0;
  if (hsapGetVersion(&version) != hsapSuccess || version != HSAP_VERSION_CODE) {
    fprintf(stderr, "version mismatch: header %d, library %d\n", HSAP_VERSION_CODE, version);
    return 1;
  }
  if (hsapLayoutCreate(&layout, cu_seqlens, 2, NULL, NULL) != hsapSuccess ||
      hsapLayoutGetVisiblePairs(layout, &pairs) != hsapSuccess) {
    fprintf(stderr, "layout failed: %s\n", hsapGetLastError());
    return 1;
  }
  hsapLayoutDestroy(layout);
  /* Two causal documents of 3 and 4 tokens: 6 + 10 visible pairs. */
  if (pairs != 16) {
    fprintf(stderr, "expected 16 visible pairs, got %lld\n", (long long)pairs);
    return 1;
  }
  printf("hsap %d: consumer ok\n", version);
  return 0;
}
