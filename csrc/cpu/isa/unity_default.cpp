// The default build of the native CPU backend. One wrapper per ISA so every extension compiles its
// own object file (setup.py builds the ISA extensions concurrently; a shared source path would
// make them write the same build/temp object).
#include "../unity.cpp"
