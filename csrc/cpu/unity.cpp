// Unity translation unit: the whole native CPU backend in one TU per ISA build. Parsing the torch
// headers dominates compile time, so one TU instead of three cuts the build roughly in half.
#include "adam_kernel.cpp"
#include "scale_l2norm.cpp"
#include "tensor_facts.cpp"
#include "bindings.cpp"
