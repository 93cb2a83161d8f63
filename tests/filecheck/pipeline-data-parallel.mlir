// RUN: hspmd-opt %s -p 'apply-strategy{strategy="[0,1]: dp=2"},propagate-layouts,insert-reshard' | filecheck %s

// A forward+backward step (autodiff,sgd{lr=0.5} of a linear+relu layer, mean-summed) made
// data parallel: activations and their gradients stay batch-split with no reshard; the
// loss and the gradient of each replicated parameter are partial sums, so each gets exactly
// one dist.reshard from partial to dup, right before the loss output / the update.

builtin.module {
  func.func @train_step() {
    %w = graph.parameter "w" {init = "normal:0.1"} : tensor<4x3xf32>
    %b = graph.parameter "b" {init = "zeros"} : tensor<3xf32>
    %x = graph.input "x" : tensor<8x4xf32>
    %y = graph.matmul %x, %w : (tensor<8x4xf32>, tensor<4x3xf32>) -> tensor<8x3xf32>
    %bb = graph.broadcast %b {dims = array<i64: 1>} : (tensor<3xf32>) -> tensor<8x3xf32>
    %z = graph.add %y, %bb : (tensor<8x3xf32>, tensor<8x3xf32>) -> tensor<8x3xf32>
    %r = graph.relu %z : (tensor<8x3xf32>) -> tensor<8x3xf32>
    %s = graph.reduce_sum %r {dims = array<i64: 0, 1>} : (tensor<8x3xf32>) -> tensor<f32>
    %l = graph.scale %s {factor = 1.250000e-01 : f64} : (tensor<f32>) -> tensor<f32>
    graph.output "loss", %l : tensor<f32>
    %0 = graph.constant {value = 1.000000e+00 : f64} : tensor<f32>
    %1 = graph.scale %0 {factor = 1.250000e-01 : f64} : (tensor<f32>) -> tensor<f32>
    %2 = graph.broadcast %1 {dims = array<i64>} : (tensor<f32>) -> tensor<8x3xf32>
    %3 = graph.relu_grad %z, %2 : (tensor<8x3xf32>, tensor<8x3xf32>) -> tensor<8x3xf32>
    %4 = graph.reduce_sum %3 {dims = array<i64: 0>} : (tensor<8x3xf32>) -> tensor<3xf32>
    %5 = graph.transpose %x {perm = array<i64: 1, 0>} : (tensor<8x4xf32>) -> tensor<4x8xf32>
    %6 = graph.matmul %5, %3 : (tensor<4x8xf32>, tensor<8x3xf32>) -> tensor<4x3xf32>
    %7 = graph.scale %6 {factor = -5.000000e-01 : f64} : (tensor<4x3xf32>) -> tensor<4x3xf32>
    %8 = graph.add %w, %7 : (tensor<4x3xf32>, tensor<4x3xf32>) -> tensor<4x3xf32>
    graph.assign "w", %8 : tensor<4x3xf32>
    %9 = graph.scale %4 {factor = -5.000000e-01 : f64} : (tensor<3xf32>) -> tensor<3xf32>
    %10 = graph.add %b, %9 : (tensor<3xf32>, tensor<3xf32>) -> tensor<3xf32>
    graph.assign "b", %10 : tensor<3xf32>
    func.return
  }
}

// CHECK-LABEL: func.func @train_step
// CHECK:         %w = graph.parameter "w" {init = "normal:0.1"} : tensor<4x3xf32, #dist.layout<"[0,1]: dup=2">>
// CHECK-NEXT:    %b = graph.parameter "b" {init = "zeros"} : tensor<3xf32, #dist.layout<"[0,1]: dup=2">>
// CHECK-NEXT:    %x = graph.input "x" : tensor<8x4xf32, #dist.layout<"[0,1]: split(0)=2">>
// CHECK-NOT:     dist.reshard
// CHECK:         %r = graph.relu %z : ({{.*}}) -> tensor<8x3xf32, #dist.layout<"[0,1]: split(0)=2">>
// CHECK-NEXT:    %s = graph.reduce_sum %r {{.*}} -> tensor<f32, #dist.layout<"[0,1]: partial=2">>
// CHECK-NEXT:    %l = graph.scale %s {{.*}} -> tensor<f32, #dist.layout<"[0,1]: partial=2">>
// CHECK-NEXT:    [[LOSS:%.*]] = dist.reshard %l : tensor<f32, #dist.layout<"[0,1]: partial=2">> -> tensor<f32, #dist.layout<"[0,1]: dup=2">>
// CHECK-NEXT:    graph.output "loss", [[LOSS]] : tensor<f32, #dist.layout<"[0,1]: dup=2">>
// CHECK-NOT:     dist.reshard
// CHECK:         [[DZ:%.*]] = graph.relu_grad %z, {{.*}} -> tensor<8x3xf32, #dist.layout<"[0,1]: split(0)=2">>
// CHECK-NEXT:    [[DB:%.*]] = graph.reduce_sum [[DZ]] {dims = array<i64: 0>} : (tensor<8x3xf32, #dist.layout<"[0,1]: split(0)=2">>) -> tensor<3xf32, #dist.layout<"[0,1]: partial=2">>
// CHECK-NOT:     dist.reshard
// CHECK:         [[DW:%.*]] = graph.matmul {{.*}}, [[DZ]] : {{.*}} -> tensor<4x3xf32, #dist.layout<"[0,1]: partial=2">>
// CHECK-NEXT:    [[SW:%.*]] = graph.scale [[DW]] {factor = -5.000000e-01 : f64} : (tensor<4x3xf32, #dist.layout<"[0,1]: partial=2">>) -> tensor<4x3xf32, #dist.layout<"[0,1]: partial=2">>
// CHECK-NEXT:    [[RW:%.*]] = dist.reshard [[SW]] : tensor<4x3xf32, #dist.layout<"[0,1]: partial=2">> -> tensor<4x3xf32, #dist.layout<"[0,1]: dup=2">>
// CHECK-NEXT:    [[NW:%.*]] = graph.add %w, [[RW]] : {{.*}} -> tensor<4x3xf32, #dist.layout<"[0,1]: dup=2">>
// CHECK-NEXT:    graph.assign "w", [[NW]] : tensor<4x3xf32, #dist.layout<"[0,1]: dup=2">>
// CHECK-NEXT:    [[SB:%.*]] = graph.scale [[DB]] {factor = -5.000000e-01 : f64} : (tensor<3xf32, #dist.layout<"[0,1]: partial=2">>) -> tensor<3xf32, #dist.layout<"[0,1]: partial=2">>
// CHECK-NEXT:    [[RB:%.*]] = dist.reshard [[SB]] : tensor<3xf32, #dist.layout<"[0,1]: partial=2">> -> tensor<3xf32, #dist.layout<"[0,1]: dup=2">>
// CHECK-NEXT:    [[NB:%.*]] = graph.add %b, [[RB]] : {{.*}} -> tensor<3xf32, #dist.layout<"[0,1]: dup=2">>
// CHECK-NEXT:    graph.assign "b", [[NB]] : tensor<3xf32, #dist.layout<"[0,1]: dup=2">>
// CHECK-NEXT:    func.return
