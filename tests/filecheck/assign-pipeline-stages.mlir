// RUN: hspmd-opt %s -p assign-pipeline-stages | filecheck %s
// RUN: hspmd-opt %s -p assign-pipeline-stages | hspmd-opt -p assign-pipeline-stages | filecheck %s

// assign-pipeline-stages on what it receives for `[0,1]: pp=2` (a two-layer model, one micro-batch:
// `autodiff,sgd,apply-strategy,propagate-layouts,insert-reshard,specialize-groups,lower-reshard`):
// the stage-shaped step on virtual device 0. Each op of @train_step gets `pipeline.stage`: the
// layers' forward ops, parameters and updates on their layer's stage (layers.0 -> 0, layers.1 -> 1),
// the backward where its layer lives (relu_grad with layer 0; the transposes of the weight and of
// a forward value with their users), free ops (the input, constants, opt.step) -1. Running it
// again overwrites the same numbers.

builtin.module attributes {dist.strategies = [#dist.strategy<id = 0, "[0,1]: dp=1 pp=2", microbatches = 1, schedule = "gpipe">]} {
  builtin.module @group0 attributes {hspmd.devices = #dist.devices<"0">} {
    func.func @train_step() {
      %w0 = graph.parameter "layers.0.weight" {init = "normal:0.1", global_type = tensor<4x4xf32, #dist.layout<"[0]: dup=1">>} : tensor<4x4xf32>
      %w1 = graph.parameter "layers.1.weight" {init = "normal:0.1", global_type = tensor<4x3xf32, #dist.layout<"[0]: dup=1">>} : tensor<4x3xf32>
      %x = graph.input "x" {global_type = tensor<8x4xf32, #dist.layout<"[0]: dup=1">>} : tensor<8x4xf32>
      %h = graph.matmul %x, %w0 : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
      %r = graph.relu %h : (tensor<8x4xf32>) -> tensor<8x4xf32>
      %y = graph.matmul %r, %w1 : (tensor<8x4xf32>, tensor<4x3xf32>) -> tensor<8x3xf32>
      %s = graph.reduce_sum %y {dims = array<i64: 0, 1>} : (tensor<8x3xf32>) -> tensor<f32>
      %l = graph.scale %s {factor = 1.250000e-01 : f64} : (tensor<f32>) -> tensor<f32>
      graph.output "loss", %l : tensor<f32>
      %0 = graph.constant {value = 1.000000e+00 : f64} : tensor<f32>
      %1 = graph.scale %0 {factor = 1.250000e-01 : f64} : (tensor<f32>) -> tensor<f32>
      %2 = graph.broadcast %1 {dims = array<i64>} : (tensor<f32>) -> tensor<8x3xf32>
      %3 = graph.transpose %w1 {perm = array<i64: 1, 0>} : (tensor<4x3xf32>) -> tensor<3x4xf32>
      %4 = graph.matmul %2, %3 : (tensor<8x3xf32>, tensor<3x4xf32>) -> tensor<8x4xf32>
      %5 = graph.transpose %r {perm = array<i64: 1, 0>} : (tensor<8x4xf32>) -> tensor<4x8xf32>
      %6 = graph.matmul %5, %2 : (tensor<4x8xf32>, tensor<8x3xf32>) -> tensor<4x3xf32>
      %7 = graph.relu_grad %h, %4 : (tensor<8x4xf32>, tensor<8x4xf32>) -> tensor<8x4xf32>
      %8 = graph.transpose %x {perm = array<i64: 1, 0>} : (tensor<8x4xf32>) -> tensor<4x8xf32>
      %9 = graph.matmul %8, %7 : (tensor<4x8xf32>, tensor<8x4xf32>) -> tensor<4x4xf32>
      %10 = graph.constant {value = 5.000000e-01 : f64} : tensor<f64>
      %11 = graph.parameter "opt.step" {init = "zeros", global_type = tensor<i64, #dist.layout<"[0]: dup=1">>} : tensor<i64>
      %12 = graph.constant {value = 1.000000e+00 : f64} : tensor<i64>
      %13 = graph.add %11, %12 : (tensor<i64>, tensor<i64>) -> tensor<i64>
      graph.assign "opt.step", %13 : tensor<i64>
      %14 = optim.sgd %w0, %9, %10 {momentum = 0.000000e+00 : f64, weight_decay = 0.000000e+00 : f64, nesterov = false} : (tensor<4x4xf32>, tensor<4x4xf32>, tensor<f64>) -> tensor<4x4xf32>
      graph.assign "layers.0.weight", %14 : tensor<4x4xf32>
      %15 = optim.sgd %w1, %6, %10 {momentum = 0.000000e+00 : f64, weight_decay = 0.000000e+00 : f64, nesterov = false} : (tensor<4x3xf32>, tensor<4x3xf32>, tensor<f64>) -> tensor<4x3xf32>
      graph.assign "layers.1.weight", %15 : tensor<4x3xf32>
      func.return
    }
  }
}

// CHECK:      %w0 = graph.parameter "layers.0.weight" {pipeline.stage = 0 : i64,
// CHECK-NEXT: %w1 = graph.parameter "layers.1.weight" {pipeline.stage = 1 : i64,
// CHECK-NEXT: %x = graph.input "x" {pipeline.stage = -1 : i64,
// CHECK-NEXT: %h = graph.matmul %x, %w0 {pipeline.stage = 0 : i64}
// CHECK-NEXT: %r = graph.relu %h {pipeline.stage = 0 : i64}
// CHECK-NEXT: %y = graph.matmul %r, %w1 {pipeline.stage = 1 : i64}
// CHECK-NEXT: %s = graph.reduce_sum %y {pipeline.stage = 1 : i64,
// CHECK-NEXT: %l = graph.scale %s {pipeline.stage = 1 : i64,
// CHECK-NEXT: graph.output "loss", %l {pipeline.stage = -1 : i64}
// CHECK-NEXT: %0 = graph.constant {pipeline.stage = -1 : i64,
// CHECK-NEXT: %1 = graph.scale %0 {pipeline.stage = -1 : i64,
// CHECK-NEXT: %2 = graph.broadcast %1 {pipeline.stage = -1 : i64,
// CHECK-NEXT: %3 = graph.transpose %w1 {pipeline.stage = 1 : i64,
// CHECK-NEXT: %4 = graph.matmul %2, %3 {pipeline.stage = 1 : i64}
// CHECK-NEXT: %5 = graph.transpose %r {pipeline.stage = 1 : i64,
// CHECK-NEXT: %6 = graph.matmul %5, %2 {pipeline.stage = 1 : i64}
// CHECK-NEXT: %7 = graph.relu_grad %h, %4 {pipeline.stage = 0 : i64}
// CHECK-NEXT: %8 = graph.transpose %x {pipeline.stage = -1 : i64,
// CHECK-NEXT: %9 = graph.matmul %8, %7 {pipeline.stage = 0 : i64}
// CHECK-NEXT: %10 = graph.constant {pipeline.stage = -1 : i64,
// CHECK-NEXT: %11 = graph.parameter "opt.step" {pipeline.stage = -1 : i64,
// CHECK-NEXT: %12 = graph.constant {pipeline.stage = -1 : i64,
// CHECK-NEXT: %13 = graph.add %11, %12 {pipeline.stage = -1 : i64}
// CHECK-NEXT: graph.assign "opt.step", %13 {pipeline.stage = -1 : i64}
// CHECK-NEXT: %14 = optim.sgd %w0, %9, %10 {pipeline.stage = 0 : i64,
// CHECK-NEXT: graph.assign "layers.0.weight", %14 {pipeline.stage = 0 : i64}
// CHECK-NEXT: %15 = optim.sgd %w1, %6, %10 {pipeline.stage = 1 : i64,
// CHECK-NEXT: graph.assign "layers.1.weight", %15 {pipeline.stage = 1 : i64}
// CHECK-NEXT: func.return
