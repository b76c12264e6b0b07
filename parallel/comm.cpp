// What parallel/comm.h offers on top of any backend.
#include "parallel/comm.h"

#include "engine/memory.h"

#include <algorithm>

namespace cw {

void sum_host_values(Communicator& comm, std::vector<double>& values) {
  if (values.empty()) return;
  const int64_t n = static_cast<int64_t>(values.size());
  OwnedTensor host(DType::f64, {n});
  std::copy(values.begin(), values.end(), host.tensor.ptr<double>());
  if (comm.device().is_cpu()) {
    comm.all_reduce(host)->wait();
  } else {
    const OwnedTensor dev = OwnedTensor::on(comm.device(), DType::f64, {n});
    copy_convert(dev, host);
    comm.all_reduce(dev)->wait();
    copy_convert(host, dev);  // after the reduction: wait() ordered the compute stream behind it
  }
  std::copy(host.tensor.ptr<double>(), host.tensor.ptr<double>() + n, values.begin());
}

}  // namespace cw
