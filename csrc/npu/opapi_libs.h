// Where the NPU binding looks for CANN's aclnn symbols: the libraries torch_npu searches, in its
// order. Standard C++ and dlfcn only, so tests compile it on a machine without CANN
// (tests/test_npu_binding.py builds a small program around OpApiLibraryCandidates()).
//
// torch_npu's op-plugin, op_plugin/utils/op_api_common.cpp (Ascend/op-plugin master, 2026-08):
// GetOpApiFuncAddr() tries, first hit wins,
//   1. libcust_opapi.so in each ASCEND_CUSTOM_OPP_PATH entry (":"-separated) + "/op_api/lib/"
//      (get_custom_lib_path), skipping a file checkOwner refuses (OwnerAllowed; also in 2.);
//   2. libcust_opapi.so in ASCEND_OPP_PATH/vendors/<vendor>/op_api/lib/ for each vendor of the
//      "load_priority=" line of ASCEND_OPP_PATH/vendors/config.ini, in that order
//      (get_default_custom_lib_path);
//   3. every libopapi_*.so in ASCEND_HOME_PATH/lib64 (GetAllOpApiSoFiles: directory order, which
//      the filesystem fixes; sorted by name here, so every run picks the same library);
//   4. libopapi.so (the dynamic loader's search path);
//   5. GetOpApiFuncAddrFromFeatureLib(): the feature libraries, kFeatureLibs in this order.
#ifndef MULTI_TENSOR_NPU_OPAPI_LIBS_H_
#define MULTI_TENSOR_NPU_OPAPI_LIBS_H_

#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>
#include <vector>

namespace multi_tensor_npu {

constexpr const char *kCustOpApiLib = "libcust_opapi.so";
constexpr const char *kOpApiLib = "libopapi.so";
constexpr const char *kFeatureLibs[] = {
    "libaclnn_ops_infer.so", "libaclnn_ops_train.so", "libaclnn_math.so",
    "libaclnn_sparse.so",    "libaclnn_fft.so",       "libaclnn_rand.so",
};

inline std::vector<std::string> SplitList(const std::string &s, char sep) {
  std::vector<std::string> out;
  std::string::size_type start = 0;
  while (start <= s.size()) {
    std::string::size_type end = s.find(sep, start);
    if (end == std::string::npos) end = s.size();
    if (end > start) out.push_back(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

inline bool IsFile(const std::string &path) {
  std::error_code ec;
  return std::filesystem::is_regular_file(path, ec);
}

// Whether a custom op library may be loaded, as op-plugin's checkOwner decides
// (op_plugin/utils/op_api_common.cpp): a root-owned file always (for any user); otherwise only
// a file of the current user, and root never loads another user's file.
inline bool OwnerAllowed(const std::string &path) {
  struct stat info;
  if (stat(path.c_str(), &info) != 0) return false;
  const uid_t me = getuid();
  if (info.st_uid == 0) return true;
  return me != 0 && info.st_uid == me;
}

// The libraries to dlopen, in search order (paths where torch_npu uses paths, else names).
inline std::vector<std::string> OpApiLibraryCandidates() {
  std::vector<std::string> libs;
  if (const char *custom = std::getenv("ASCEND_CUSTOM_OPP_PATH")) {
    for (const std::string &dir : SplitList(custom, ':')) {
      std::string lib = dir + "/op_api/lib/" + kCustOpApiLib;
      if (IsFile(lib) && OwnerAllowed(lib)) libs.push_back(lib);
    }
  }
  if (const char *opp = std::getenv("ASCEND_OPP_PATH")) {
    std::string vendors = std::string(opp) + "/vendors";
    std::ifstream config(vendors + "/config.ini");
    std::string line;
    const std::string head = "load_priority=";
    while (std::getline(config, line)) {
      if (line.compare(0, head.size(), head) == 0) {
        for (const std::string &vendor : SplitList(line.substr(head.size()), ',')) {
          std::string lib = vendors + "/" + vendor + "/op_api/lib/" + kCustOpApiLib;
          if (IsFile(lib) && OwnerAllowed(lib)) libs.push_back(lib);
        }
        break;
      }
    }
  }
  if (const char *home = std::getenv("ASCEND_HOME_PATH")) {
    std::vector<std::string> found;
    std::error_code ec;
    std::filesystem::directory_iterator it(std::string(home) + "/lib64", ec), end;
    for (; !ec && it != end; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      if (name.size() > 12 && name.compare(0, 9, "libopapi_") == 0 &&
          name.compare(name.size() - 3, 3, ".so") == 0 && IsFile(it->path().string())) {
        found.push_back(name);
      }
    }
    std::sort(found.begin(), found.end());
    libs.insert(libs.end(), found.begin(), found.end());
  }
  libs.push_back(kOpApiLib);
  for (const char *lib : kFeatureLibs) libs.push_back(lib);
  return libs;
}

// The first definition of `name` in the candidates (nullptr if none); handles opened once.
inline void *OpApiSymbol(const char *name) {
  static const std::vector<void *> handles = [] {
    std::vector<void *> out;
    for (const std::string &lib : OpApiLibraryCandidates()) {
      out.push_back(dlopen(lib.c_str(), RTLD_LAZY));
    }
    return out;
  }();
  for (void *handle : handles) {
    if (handle == nullptr) continue;
    if (void *addr = dlsym(handle, name)) return addr;
  }
  return nullptr;
}

}  // namespace multi_tensor_npu

#endif  // MULTI_TENSOR_NPU_OPAPI_LIBS_H_
