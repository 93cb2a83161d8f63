// RUN: hspmd-opt %s -p outline-pipeline-stages | filecheck %s

// outline-pipeline-stages on what it receives for `[0-3]: dp=2 pp=2` with 2 micro-batches (a
// two-layer model; `...,lower-reshard,assign-pipeline-stages`): the stage-shaped step on virtual
// devices 0-3 (micro-batch x dp rank), each op with its `pipeline.stage`. Stage 0 (devices 0,1)
// and stage 1 (2,3) each get @train_step (pre, one pipeline.run, post) and one micro-batch's
// @pipeline_forward / @pipeline_backward; x is read as x@mb (2 micro-batches of 4 rows, split over
// the stage's dp ranks along dim 1); the all-reduces over virtual 0-3 become the run's sums, then
// all-reduces over the stage's 2 dp ranks; values cross stages by send/recv between the same
// position, tagged 1, 2, 3. No `pipeline.stage` attribute is left.

builtin.module attributes {dist.strategies = [#dist.strategy<id = 0, "[0-3]: dp=2 pp=2", microbatches = 2, schedule = "gpipe">]} {
  builtin.module @group0 attributes {hspmd.devices = #dist.devices<"0-3">} {
    func.func @train_step() {
      %w0 = graph.parameter "layers.0.weight" {pipeline.stage = 0 : i64, init = "normal:0.1", global_type = tensor<4x4xf32, #dist.layout<"[0-3]: dup=4">>} : tensor<4x4xf32>
      %w1 = graph.parameter "layers.1.weight" {pipeline.stage = 1 : i64, init = "normal:0.1", global_type = tensor<4x3xf32, #dist.layout<"[0-3]: dup=4">>} : tensor<4x3xf32>
      %x = graph.input "x" {pipeline.stage = -1 : i64, global_type = tensor<8x4xf32, #dist.layout<"[0-3]: split(0)=4">>} : tensor<2x4xf32>
      %h = graph.matmul %x, %w0 {pipeline.stage = 0 : i64} : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>
      %r = graph.relu %h {pipeline.stage = 0 : i64} : (tensor<2x4xf32>) -> tensor<2x4xf32>
      %y = graph.matmul %r, %w1 {pipeline.stage = 1 : i64} : (tensor<2x4xf32>, tensor<4x3xf32>) -> tensor<2x3xf32>
      %s = graph.reduce_sum %y {pipeline.stage = 1 : i64, dims = array<i64: 0, 1>} : (tensor<2x3xf32>) -> tensor<f32>
      %l = graph.scale %s {pipeline.stage = 1 : i64, factor = 1.250000e-01 : f64} : (tensor<f32>) -> tensor<f32>
      %0 = comm.all_reduce %l {pipeline.stage = 1 : i64, groups = #dist.groups<"{0-3}">} : tensor<f32> -> tensor<f32>
      graph.output "loss", %0 {pipeline.stage = -1 : i64} : tensor<f32>
      %1 = graph.constant {pipeline.stage = -1 : i64, value = 1.000000e+00 : f64} : tensor<f32>
      %2 = graph.scale %1 {pipeline.stage = -1 : i64, factor = 1.250000e-01 : f64} : (tensor<f32>) -> tensor<f32>
      %3 = graph.broadcast %2 {pipeline.stage = -1 : i64, dims = array<i64>} : (tensor<f32>) -> tensor<2x3xf32>
      %4 = graph.transpose %w1 {pipeline.stage = 1 : i64, perm = array<i64: 1, 0>} : (tensor<4x3xf32>) -> tensor<3x4xf32>
      %5 = graph.matmul %3, %4 {pipeline.stage = 1 : i64} : (tensor<2x3xf32>, tensor<3x4xf32>) -> tensor<2x4xf32>
      %6 = graph.transpose %r {pipeline.stage = 1 : i64, perm = array<i64: 1, 0>} : (tensor<2x4xf32>) -> tensor<4x2xf32>
      %7 = graph.matmul %6, %3 {pipeline.stage = 1 : i64} : (tensor<4x2xf32>, tensor<2x3xf32>) -> tensor<4x3xf32>
      %8 = graph.relu_grad %h, %5 {pipeline.stage = 0 : i64} : (tensor<2x4xf32>, tensor<2x4xf32>) -> tensor<2x4xf32>
      %9 = graph.transpose %x {pipeline.stage = -1 : i64, perm = array<i64: 1, 0>} : (tensor<2x4xf32>) -> tensor<4x2xf32>
      %10 = graph.matmul %9, %8 {pipeline.stage = 0 : i64} : (tensor<4x2xf32>, tensor<2x4xf32>) -> tensor<4x4xf32>
      %11 = graph.constant {pipeline.stage = -1 : i64, value = 5.000000e-01 : f64} : tensor<f64>
      %12 = graph.parameter "opt.step" {pipeline.stage = -1 : i64, init = "zeros", global_type = tensor<i64, #dist.layout<"[0-3]: dup=4">>} : tensor<i64>
      %13 = graph.constant {pipeline.stage = -1 : i64, value = 1.000000e+00 : f64} : tensor<i64>
      %14 = graph.add %12, %13 {pipeline.stage = -1 : i64} : (tensor<i64>, tensor<i64>) -> tensor<i64>
      graph.assign "opt.step", %14 {pipeline.stage = -1 : i64} : tensor<i64>
      %15 = comm.all_reduce %10 {pipeline.stage = 0 : i64, groups = #dist.groups<"{0-3}">} : tensor<4x4xf32> -> tensor<4x4xf32>
      %16 = optim.sgd %w0, %15, %11 {pipeline.stage = 0 : i64, momentum = 0.000000e+00 : f64, weight_decay = 0.000000e+00 : f64, nesterov = false} : (tensor<4x4xf32>, tensor<4x4xf32>, tensor<f64>) -> tensor<4x4xf32>
      graph.assign "layers.0.weight", %16 {pipeline.stage = 0 : i64} : tensor<4x4xf32>
      %17 = comm.all_reduce %7 {pipeline.stage = 1 : i64, groups = #dist.groups<"{0-3}">} : tensor<4x3xf32> -> tensor<4x3xf32>
      %18 = optim.sgd %w1, %17, %11 {pipeline.stage = 1 : i64, momentum = 0.000000e+00 : f64, weight_decay = 0.000000e+00 : f64, nesterov = false} : (tensor<4x3xf32>, tensor<4x3xf32>, tensor<f64>) -> tensor<4x3xf32>
      graph.assign "layers.1.weight", %18 {pipeline.stage = 1 : i64} : tensor<4x3xf32>
      func.return
    }
  }
}

// CHECK-NOT:   pipeline.stage =
// CHECK:       builtin.module @group0 attributes {hspmd.devices = #dist.devices<"0,1">, hspmd.pipeline_stage = 0 : i64, hspmd.microbatches = 2 : i64} {
// CHECK:         %w0 = graph.parameter "layers.0.weight" {{.*}}global_type = tensor<4x4xf32, #dist.layout<"[0,1]: dup=2">>} : tensor<4x4xf32>
// CHECK-NEXT:    %[[X:.*]] = graph.input "x@mb" {global_type = tensor<2x4x4xf32, #dist.layout<"[0,1]: split(1)=2">>} : tensor<2x2x4xf32>
// CHECK-NEXT:    %[[DH:.*]] = comm.recv {pairs = #dist.pairs<"2,3->0,1">, tag = 2 : i64} : tensor<2x4xf32>
// CHECK-NEXT:    %[[G0:.*]] = pipeline.run @pipeline_forward, @pipeline_backward(%w0, %[[DH]]) (%[[X]]) {schedule = "gpipe", stage = 0 : i64, stages = 2 : i64, microbatches = 2 : i64, stash = 1 : i64}
// CHECK-NEXT:    %[[L0:.*]] = comm.recv {pairs = #dist.pairs<"2,3->0,1">, tag = 1 : i64} : tensor<f32>
// CHECK-NEXT:    graph.output "loss", %[[L0]] : tensor<f32>
// CHECK:         %[[R0:.*]] = comm.all_reduce %[[G0]] {groups = #dist.groups<"{0,1}">} : tensor<4x4xf32> -> tensor<4x4xf32>
// CHECK:         optim.sgd %w0, %[[R0]]
// CHECK:       func.func private @pipeline_forward(%{{.*}}: tensor<4x4xf32>, %{{.*}}: tensor<2x4xf32>, %{{.*}}: tensor<2x4xf32>) -> tensor<2x4xf32> {
// CHECK:         %r = graph.relu %h
// CHECK-NEXT:    comm.send %r {pairs = #dist.pairs<"0,1->2,3">, tag = 3 : i64} : tensor<2x4xf32>
// CHECK-NEXT:    func.return %h : tensor<2x4xf32>
// CHECK:       func.func private @pipeline_backward(
// CHECK:         graph.relu_grad
// CHECK:       builtin.module @group1 attributes {hspmd.devices = #dist.devices<"2,3">, hspmd.pipeline_stage = 1 : i64, hspmd.microbatches = 2 : i64} {
// CHECK:         comm.send %{{.*}} {pairs = #dist.pairs<"2,3->0,1">, tag = 2 : i64} : tensor<2x4xf32>
// CHECK-NEXT:    %[[L1:.*]], %[[G1:.*]] = pipeline.run @pipeline_forward, @pipeline_backward(%w1, %{{.*}}) () {schedule = "gpipe", stage = 1 : i64, stages = 2 : i64, microbatches = 2 : i64, stash = 1 : i64}
// CHECK-NEXT:    %[[L:.*]] = comm.all_reduce %[[L1]] {groups = #dist.groups<"{2,3}">} : tensor<f32> -> tensor<f32>
// CHECK-NEXT:    comm.send %[[L]] {pairs = #dist.pairs<"2,3->0,1">, tag = 1 : i64} : tensor<f32>
// CHECK-NEXT:    graph.output "loss", %[[L]] : tensor<f32>
// CHECK:         comm.all_reduce %[[G1]] {groups = #dist.groups<"{2,3}">} : tensor<4x3xf32> -> tensor<4x3xf32>
// CHECK:       func.func private @pipeline_forward(
// CHECK-NEXT:    comm.recv {pairs = #dist.pairs<"0,1->2,3">, tag = 3 : i64} : tensor<2x4xf32>
// CHECK-NOT:   pipeline.stage =
