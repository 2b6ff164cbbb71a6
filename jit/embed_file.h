// Embeds a file of the source tree into the library at build time with the assembler's
// .incbin: no build step, and no copy of the text in a C++ string that could drift from the
// file. The unit that uses it needs HSAP_SOURCE_DIR (CMakeLists.txt defines it on those
// units only) and should name the file in its OBJECT_DEPENDS or include it, so that the
// build recompiles the unit when the file changes.
#ifndef HSAP_JIT_EMBED_FILE_H_
#define HSAP_JIT_EMBED_FILE_H_

// Defines `symbol` (the text, NUL-terminated) and `symbol##_end` (its end, before the NUL)
// for the file at `path`, relative to the source root. Use at namespace scope.
#define HSAP_EMBED_FILE(symbol, path)       \
  __asm__(                                  \
      ".pushsection .rodata\n"              \
      ".balign 16\n"                        \
      ".global " #symbol                    \
      "\n"                                  \
      ".hidden " #symbol "\n" #symbol       \
      ":\n"                                 \
      ".incbin \"" HSAP_SOURCE_DIR "/" path \
      "\"\n"                                \
      ".global " #symbol                    \
      "_end\n"                              \
      ".hidden " #symbol "_end\n" #symbol   \
      "_end:\n"                             \
      ".byte 0\n"                           \
      ".popsection\n");                     \
  extern "C" const char symbol[];           \
  extern "C" const char symbol##_end[]

#endif  // HSAP_JIT_EMBED_FILE_H_
