// The one definition of each neural-network kernel family's dispatch stub (declared in kernels/nn.h).
#include "booster/kernels/nn.h"

namespace booster::kernels {

BOOSTER_DEFINE_KERNEL(softmax_kernel);
BOOSTER_DEFINE_KERNEL(softmax_backward_kernel);
BOOSTER_DEFINE_KERNEL(layer_norm_kernel);
BOOSTER_DEFINE_KERNEL(layer_norm_backward_kernel);
BOOSTER_DEFINE_KERNEL(batch_norm_kernel);
BOOSTER_DEFINE_KERNEL(batch_norm_backward_kernel);
BOOSTER_DEFINE_KERNEL(masked_scale_kernel);
BOOSTER_DEFINE_KERNEL(attention_kernel);
BOOSTER_DEFINE_KERNEL(attention_backward_kernel);
BOOSTER_DEFINE_KERNEL(flash_attention_kernel);
BOOSTER_DEFINE_KERNEL(flash_attention_backward_kernel);
BOOSTER_DEFINE_KERNEL(cross_entropy_kernel);
BOOSTER_DEFINE_KERNEL(cross_entropy_backward_kernel);
BOOSTER_DEFINE_KERNEL(classifier_loss_kernel);
BOOSTER_DEFINE_KERNEL(classifier_loss_backward_kernel);
BOOSTER_DEFINE_KERNEL(nll_loss_kernel);
BOOSTER_DEFINE_KERNEL(nll_loss_backward_kernel);
BOOSTER_DEFINE_KERNEL(mse_loss_kernel);
BOOSTER_DEFINE_KERNEL(mse_loss_backward_kernel);

}  // namespace booster::kernels
