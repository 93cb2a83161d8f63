// RUN: hspmd-opt %s -p 'autodiff,apply-strategy{strategy="[0,1]: dp=2"},propagate-layouts,insert-reshard' | filecheck %s

// Data parallel layer_norm: the batch stays split through the forward and dx; dweight and
// dbias sum over the batch, so they come out partial and are all-reduced (reshard to dup)
// before they are output. The normalised dim is never split.

builtin.module {
  func.func @train_step() {
    %x = graph.input "x" : tensor<4x2x8xf32>
    %g = graph.parameter "g" {init = "ones"} : tensor<8xf32>
    %b = graph.parameter "b" {init = "zeros"} : tensor<8xf32>
    %y = graph.layer_norm %x, %g, %b {eps = 1.000000e-05 : f64} : (tensor<4x2x8xf32>, tensor<8xf32>, tensor<8xf32>) -> tensor<4x2x8xf32>
    %l = graph.reduce_sum %y {dims = array<i64: 0, 1, 2>} : (tensor<4x2x8xf32>) -> tensor<f32>
    graph.output "loss", %l : tensor<f32>
    func.return
  }
}

// CHECK:       %y = graph.layer_norm %x, %g, %b {{.*}} -> tensor<4x2x8xf32, #dist.layout<"[0,1]: split(0)=2">>
// CHECK:       [[DX:%.*]], [[DG:%.*]], [[DB:%.*]] = graph.layer_norm_grad %x, %g, {{%.*}} {eps = 1.000000e-05 : f64}
// CHECK-SAME:    -> (tensor<4x2x8xf32, #dist.layout<"[0,1]: split(0)=2">>, tensor<8xf32, #dist.layout<"[0,1]: partial=2">>, tensor<8xf32, #dist.layout<"[0,1]: partial=2">>)
// CHECK-NEXT:  [[RG:%.*]] = dist.reshard [[DG]] : tensor<8xf32, #dist.layout<"[0,1]: partial=2">> -> tensor<8xf32, #dist.layout<"[0,1]: dup=2">>
// CHECK-NEXT:  graph.output "grad:g", [[RG]]
// CHECK-NEXT:  [[RB:%.*]] = dist.reshard [[DB]] : tensor<8xf32, #dist.layout<"[0,1]: partial=2">> -> tensor<8xf32, #dist.layout<"[0,1]: dup=2">>
// CHECK-NEXT:  graph.output "grad:b", [[RB]]
