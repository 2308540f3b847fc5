// torchvision's operator library for a CPU-only torch, built at set-up.
//
// PyPI's torchvision wheel is built for CUDA torch: its _C.so needs
// libtorch_cuda.so and does not load beside the CPU torch wheel, and
// torchvision then fails at import (it registers fake kernels for
// torchvision::nms unconditionally). The vision-language processors only use
// torchvision's Python transforms, so this library declares torchvision's
// operator schemas (as the wheel's _C.so does) and implements nms on CPU.
// The detection ops (roi_align, deform_conv2d, ...) have no kernel here:
// calling one fails with torch's "Could not run ... CPU backend" error.
#include <torch/library.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <numeric>
#include <vector>

namespace {

// Greedy NMS: boxes in (x1, y1, x2, y2); returns the kept indices by
// descending score, like torchvision's CPU kernel.
at::Tensor nms_cpu(const at::Tensor& dets, const at::Tensor& scores, double iou_threshold) {
  TORCH_CHECK(dets.dim() == 2 && dets.size(1) == 4, "boxes should be a [N, 4] tensor");
  TORCH_CHECK(scores.dim() == 1 && scores.size(0) == dets.size(0),
              "scores should be a [N] tensor matching boxes");
  const int64_t n = dets.size(0);
  auto boxes = dets.to(at::kDouble).contiguous();
  auto score = scores.to(at::kDouble).contiguous();
  const double* b = boxes.data_ptr<double>();
  const double* s = score.data_ptr<double>();
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t i, int64_t j) { return s[i] > s[j]; });
  std::vector<char> suppressed(n, 0);
  std::vector<int64_t> keep;
  for (int64_t a = 0; a < n; ++a) {
    const int64_t i = order[a];
    if (suppressed[i]) continue;
    keep.push_back(i);
    const double area_i = (b[4 * i + 2] - b[4 * i]) * (b[4 * i + 3] - b[4 * i + 1]);
    for (int64_t c = a + 1; c < n; ++c) {
      const int64_t j = order[c];
      if (suppressed[j]) continue;
      const double w = std::max(0.0, std::min(b[4 * i + 2], b[4 * j + 2]) - std::max(b[4 * i], b[4 * j]));
      const double h = std::max(0.0, std::min(b[4 * i + 3], b[4 * j + 3]) - std::max(b[4 * i + 1], b[4 * j + 1]));
      const double inter = w * h;
      const double area_j = (b[4 * j + 2] - b[4 * j]) * (b[4 * j + 3] - b[4 * j + 1]);
      if (inter / (area_i + area_j - inter) > iou_threshold) suppressed[j] = 1;
    }
  }
  return at::tensor(keep, at::TensorOptions().dtype(at::kLong));
}

int64_t cuda_version() { return -1; }

}  // namespace

TORCH_LIBRARY(torchvision, m) {
  m.def("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor");
  m.def("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor");
  m.def("roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
        "SymInt pooled_width, int sampling_ratio, bool aligned) -> Tensor");
  m.def("_roi_align_backward(Tensor grad, Tensor rois, float spatial_scale, SymInt pooled_height, "
        "SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width, "
        "int sampling_ratio, bool aligned) -> Tensor");
  m.def("qroi_align(Tensor input, Tensor rois, float input_scale, int input_zero_point, "
        "float rois_scale, int rois_zero_point, float spatial_scale, SymInt pooled_height, "
        "SymInt pooled_width, int sampling_ratio, bool aligned) -> Tensor");
  m.def("roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
        "SymInt pooled_width) -> (Tensor, Tensor)");
  m.def("_roi_pool_backward(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale, "
        "SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, "
        "SymInt height, SymInt width) -> Tensor");
  m.def("ps_roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
        "SymInt pooled_width, int sampling_ratio) -> (Tensor, Tensor)");
  m.def("_ps_roi_align_backward(Tensor grad, Tensor rois, Tensor channel_mapping, "
        "float spatial_scale, SymInt pooled_height, SymInt pooled_width, int sampling_ratio, "
        "SymInt batch_size, SymInt channels, SymInt height, SymInt width) -> Tensor");
  m.def("ps_roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
        "SymInt pooled_width) -> (Tensor, Tensor)");
  m.def("_ps_roi_pool_backward(Tensor grad, Tensor rois, Tensor channel_mapping, "
        "float spatial_scale, SymInt pooled_height, SymInt pooled_width, SymInt batch_size, "
        "SymInt channels, SymInt height, SymInt width) -> Tensor");
  m.def("deform_conv2d(Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, "
        "SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, "
        "SymInt dilation_w, SymInt groups, SymInt offset_groups, bool use_mask) -> Tensor");
  m.def("_deform_conv2d_backward(Tensor grad, Tensor input, Tensor weight, Tensor offset, "
        "Tensor mask, Tensor bias, SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, "
        "SymInt dilation_h, SymInt dilation_w, SymInt groups, SymInt offset_groups, bool use_mask) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("box_iou_rotated(Tensor boxes1, Tensor boxes2) -> Tensor");
  m.def("_cuda_version", &cuda_version);
}

TORCH_LIBRARY_IMPL(torchvision, CPU, m) {
  m.impl("nms", &nms_cpu);
}
