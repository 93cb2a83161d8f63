// RUN: hspmd-opt %s -p join-pipeline-groups | filecheck %s

// join-pipeline-groups on what it receives for `[0,1]: pp=2 share=3 | [2]: dp=1 share=1` (a two-layer
// model; `...,lower-reshard,assign-pipeline-stages,outline-pipeline-stages`): stage 0 (device 0) and
// stage 1 (device 1) are cut, their collectives with group [2] marked `pipeline.cross = k` (k: the
// order of the stage-shaped step: the loss 0, layer 0's gradient 1, layer 1's 2); group [2] still
// names the virtual device 0. The join renames, per op, each of group [2]'s collectives onto the
// stage that runs its match (the loss and layer 1 onto device 1), a parameter's layout onto its
// owner's stage, marks group [2] a one-stage pipeline, and re-orders its step so that its
// collectives follow one order every rank agrees with: layer 0's sum (stage 0's only event) after
// the loss but before layer 1's. The marks are dropped.

builtin.module attributes {dist.strategies = [#dist.strategy<id = 0, "[0,1]: dp=1 pp=2 share=3 | [2]: dp=1", microbatches = 1, schedule = "gpipe">]} {
  builtin.module @group0 attributes {hspmd.devices = #dist.devices<"0">, hspmd.pipeline_stage = 0 : i64, hspmd.microbatches = 1 : i64} {
    func.func @train_step() {
      %w0 = graph.parameter "layers.0.weight" {init = "normal:0.1", global_type = tensor<4x4xf32, #dist.layout<"[0]: dup=1 | [2]: dup=1 ; hetero=dup">>} : tensor<4x4xf32>
      %0 = graph.input "x@mb" {global_type = tensor<1x8x4xf32, #dist.layout<"[0]: dup=1 | [2]: dup=1 ; hetero=split(1), shares=3:1">>} : tensor<1x6x4xf32>
      %1 = comm.recv {pairs = #dist.pairs<"1->0">, tag = 2 : i64} : tensor<6x4xf32>
      %2 = pipeline.run @pipeline_forward, @pipeline_backward(%w0, %1) (%0) {schedule = "gpipe", stage = 0 : i64, stages = 2 : i64, microbatches = 1 : i64, stash = 1 : i64} : (tensor<4x4xf32>, tensor<6x4xf32>) (tensor<1x6x4xf32>) -> (tensor<4x4xf32>)
      %3 = comm.recv {pairs = #dist.pairs<"1->0">, tag = 1 : i64} : tensor<f32>
      graph.output "loss", %3 : tensor<f32>
      %4 = graph.parameter "opt.step" {init = "zeros", global_type = tensor<i64, #dist.layout<"[0]: dup=1 | [2]: dup=1 ; hetero=dup">>} : tensor<i64>
      %5 = graph.constant {value = 1.000000e+00 : f64} : tensor<i64>
      %6 = graph.add %4, %5 : (tensor<i64>, tensor<i64>) -> tensor<i64>
      graph.assign "opt.step", %6 : tensor<i64>
      %7 = graph.constant {value = 5.000000e-01 : f64} : tensor<f64>
      %8 = optim.sgd %w0, %2, %7 {momentum = 0.000000e+00 : f64, weight_decay = 0.000000e+00 : f64, nesterov = false} : (tensor<4x4xf32>, tensor<4x4xf32>, tensor<f64>) -> tensor<4x4xf32>
      graph.assign "layers.0.weight", %8 : tensor<4x4xf32>
      func.return
    }
    func.func private @pipeline_forward(%0: tensor<4x4xf32>, %1: tensor<6x4xf32>, %2: tensor<6x4xf32>) -> tensor<6x4xf32> {
      %h = graph.matmul %2, %0 : (tensor<6x4xf32>, tensor<4x4xf32>) -> tensor<6x4xf32>
      %r = graph.relu %h : (tensor<6x4xf32>) -> tensor<6x4xf32>
      comm.send %r {pairs = #dist.pairs<"0->1">, tag = 3 : i64} : tensor<6x4xf32>
      func.return %h : tensor<6x4xf32>
    }
    func.func private @pipeline_backward(%0: tensor<4x4xf32>, %1: tensor<6x4xf32>, %2: tensor<6x4xf32>, %3: tensor<6x4xf32>) -> tensor<4x4xf32> {
      %4 = graph.relu_grad %3, %1 : (tensor<6x4xf32>, tensor<6x4xf32>) -> tensor<6x4xf32>
      %5 = graph.transpose %2 {perm = array<i64: 1, 0>} : (tensor<6x4xf32>) -> tensor<4x6xf32>
      %6 = graph.matmul %5, %4 : (tensor<4x6xf32>, tensor<6x4xf32>) -> tensor<4x4xf32>
      %7 = comm.all_reduce %6 {pipeline.cross = 1 : i64, groups = #dist.groups<"{0,2}">} : tensor<4x4xf32> -> tensor<4x4xf32>
      func.return %7 : tensor<4x4xf32>
    }
  }
  builtin.module @group1 attributes {hspmd.devices = #dist.devices<"1">, hspmd.pipeline_stage = 1 : i64, hspmd.microbatches = 1 : i64} {
    func.func @train_step() {
      %w1 = graph.parameter "layers.1.weight" {init = "normal:0.1", global_type = tensor<4x3xf32, #dist.layout<"[1]: dup=1 | [2]: dup=1 ; hetero=dup">>} : tensor<4x3xf32>
      %0 = graph.transpose %w1 {perm = array<i64: 1, 0>} : (tensor<4x3xf32>) -> tensor<3x4xf32>
      %1 = graph.constant {value = 1.000000e+00 : f64} : tensor<f32>
      %2 = graph.scale %1 {factor = 1.250000e-01 : f64} : (tensor<f32>) -> tensor<f32>
      %3 = graph.broadcast %2 {dims = array<i64>} : (tensor<f32>) -> tensor<6x3xf32>
      %4 = graph.matmul %3, %0 : (tensor<6x3xf32>, tensor<3x4xf32>) -> tensor<6x4xf32>
      comm.send %4 {pairs = #dist.pairs<"1->0">, tag = 2 : i64} : tensor<6x4xf32>
      %5, %6 = pipeline.run @pipeline_forward, @pipeline_backward(%w1, %3) () {schedule = "gpipe", stage = 1 : i64, stages = 2 : i64, microbatches = 1 : i64, stash = 1 : i64} : (tensor<4x3xf32>, tensor<6x3xf32>) () -> (tensor<f32>, tensor<4x3xf32>)
      comm.send %5 {pairs = #dist.pairs<"1->0">, tag = 1 : i64} : tensor<f32>
      graph.output "loss", %5 : tensor<f32>
      %7 = graph.parameter "opt.step" {init = "zeros", global_type = tensor<i64, #dist.layout<"[1]: dup=1 | [2]: dup=1 ; hetero=dup">>} : tensor<i64>
      %8 = graph.constant {value = 1.000000e+00 : f64} : tensor<i64>
      %9 = graph.add %7, %8 : (tensor<i64>, tensor<i64>) -> tensor<i64>
      graph.assign "opt.step", %9 : tensor<i64>
      %10 = graph.constant {value = 5.000000e-01 : f64} : tensor<f64>
      %11 = optim.sgd %w1, %6, %10 {momentum = 0.000000e+00 : f64, weight_decay = 0.000000e+00 : f64, nesterov = false} : (tensor<4x3xf32>, tensor<4x3xf32>, tensor<f64>) -> tensor<4x3xf32>
      graph.assign "layers.1.weight", %11 : tensor<4x3xf32>
      func.return
    }
    func.func private @pipeline_forward(%0: tensor<4x3xf32>, %1: tensor<6x3xf32>) -> (tensor<6x4xf32>, tensor<f32>) {
      %2 = comm.recv {pairs = #dist.pairs<"0->1">, tag = 3 : i64} : tensor<6x4xf32>
      %y = graph.matmul %2, %0 : (tensor<6x4xf32>, tensor<4x3xf32>) -> tensor<6x3xf32>
      %s = graph.reduce_sum %y {dims = array<i64: 0, 1>} : (tensor<6x3xf32>) -> tensor<f32>
      %l = graph.scale %s {factor = 1.250000e-01 : f64} : (tensor<f32>) -> tensor<f32>
      %3 = comm.all_reduce %l {pipeline.cross = 0 : i64, groups = #dist.groups<"{1,2}">} : tensor<f32> -> tensor<f32>
      func.return %2, %3 : tensor<6x4xf32>, tensor<f32>
    }
    func.func private @pipeline_backward(%0: tensor<4x3xf32>, %1: tensor<6x3xf32>, %2: tensor<6x4xf32>) -> tensor<4x3xf32> {
      %3 = graph.transpose %2 {perm = array<i64: 1, 0>} : (tensor<6x4xf32>) -> tensor<4x6xf32>
      %4 = graph.matmul %3, %1 : (tensor<4x6xf32>, tensor<6x3xf32>) -> tensor<4x3xf32>
      %5 = comm.all_reduce %4 {pipeline.cross = 2 : i64, groups = #dist.groups<"{1,2}">} : tensor<4x3xf32> -> tensor<4x3xf32>
      func.return %5 : tensor<4x3xf32>
    }
  }
  builtin.module @group2 attributes {hspmd.devices = #dist.devices<"2">} {
    func.func @train_step() {
      %w0 = graph.parameter "layers.0.weight" {init = "normal:0.1", global_type = tensor<4x4xf32, #dist.layout<"[0]: dup=1 | [2]: dup=1 ; hetero=dup">>} : tensor<4x4xf32>
      %w1 = graph.parameter "layers.1.weight" {init = "normal:0.1", global_type = tensor<4x3xf32, #dist.layout<"[0]: dup=1 | [2]: dup=1 ; hetero=dup">>} : tensor<4x3xf32>
      %x = graph.input "x" {global_type = tensor<8x4xf32, #dist.layout<"[0]: dup=1 | [2]: dup=1 ; hetero=split(0), shares=3:1">>} : tensor<2x4xf32>
      %h = graph.matmul %x, %w0 : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>
      %r = graph.relu %h : (tensor<2x4xf32>) -> tensor<2x4xf32>
      %y = graph.matmul %r, %w1 : (tensor<2x4xf32>, tensor<4x3xf32>) -> tensor<2x3xf32>
      %s = graph.reduce_sum %y {dims = array<i64: 0, 1>} : (tensor<2x3xf32>) -> tensor<f32>
      %l = graph.scale %s {factor = 1.250000e-01 : f64} : (tensor<f32>) -> tensor<f32>
      %0 = comm.all_reduce %l {groups = #dist.groups<"{0,2}">} : tensor<f32> -> tensor<f32>
      graph.output "loss", %0 : tensor<f32>
      %1 = graph.constant {value = 1.000000e+00 : f64} : tensor<f32>
      %2 = graph.scale %1 {factor = 1.250000e-01 : f64} : (tensor<f32>) -> tensor<f32>
      %3 = graph.broadcast %2 {dims = array<i64>} : (tensor<f32>) -> tensor<2x3xf32>
      %4 = graph.transpose %w1 {perm = array<i64: 1, 0>} : (tensor<4x3xf32>) -> tensor<3x4xf32>
      %5 = graph.matmul %3, %4 : (tensor<2x3xf32>, tensor<3x4xf32>) -> tensor<2x4xf32>
      %6 = graph.transpose %r {perm = array<i64: 1, 0>} : (tensor<2x4xf32>) -> tensor<4x2xf32>
      %7 = graph.matmul %6, %3 : (tensor<4x2xf32>, tensor<2x3xf32>) -> tensor<4x3xf32>
      %8 = graph.relu_grad %h, %5 : (tensor<2x4xf32>, tensor<2x4xf32>) -> tensor<2x4xf32>
      %9 = graph.transpose %x {perm = array<i64: 1, 0>} : (tensor<2x4xf32>) -> tensor<4x2xf32>
      %10 = graph.matmul %9, %8 : (tensor<4x2xf32>, tensor<2x4xf32>) -> tensor<4x4xf32>
      %11 = graph.constant {value = 5.000000e-01 : f64} : tensor<f64>
      %12 = graph.parameter "opt.step" {init = "zeros", global_type = tensor<i64, #dist.layout<"[0]: dup=1 | [2]: dup=1 ; hetero=dup">>} : tensor<i64>
      %13 = graph.constant {value = 1.000000e+00 : f64} : tensor<i64>
      %14 = graph.add %12, %13 : (tensor<i64>, tensor<i64>) -> tensor<i64>
      graph.assign "opt.step", %14 : tensor<i64>
      %15 = comm.all_reduce %10 {groups = #dist.groups<"{0,2}">} : tensor<4x4xf32> -> tensor<4x4xf32>
      %16 = optim.sgd %w0, %15, %11 {momentum = 0.000000e+00 : f64, weight_decay = 0.000000e+00 : f64, nesterov = false} : (tensor<4x4xf32>, tensor<4x4xf32>, tensor<f64>) -> tensor<4x4xf32>
      graph.assign "layers.0.weight", %16 : tensor<4x4xf32>
      %17 = comm.all_reduce %7 {groups = #dist.groups<"{0,2}">} : tensor<4x3xf32> -> tensor<4x3xf32>
      %18 = optim.sgd %w1, %17, %11 {momentum = 0.000000e+00 : f64, weight_decay = 0.000000e+00 : f64, nesterov = false} : (tensor<4x3xf32>, tensor<4x3xf32>, tensor<f64>) -> tensor<4x3xf32>
      graph.assign "layers.1.weight", %18 : tensor<4x3xf32>
      func.return
    }
  }
}

// CHECK-NOT:   pipeline.cross
// CHECK:       builtin.module @group0 attributes {hspmd.devices = #dist.devices<"0">, hspmd.pipeline_stage = 0 : i64, hspmd.microbatches = 1 : i64} {
// CHECK:         comm.all_reduce %{{.*}} {groups = #dist.groups<"{0,2}">} : tensor<4x4xf32> -> tensor<4x4xf32>
// CHECK:       builtin.module @group1 attributes {hspmd.devices = #dist.devices<"1">, hspmd.pipeline_stage = 1 : i64, hspmd.microbatches = 1 : i64} {
// CHECK:         comm.all_reduce %l {groups = #dist.groups<"{1,2}">} : tensor<f32> -> tensor<f32>
// CHECK:         comm.all_reduce %{{.*}} {groups = #dist.groups<"{1,2}">} : tensor<4x3xf32> -> tensor<4x3xf32>
// CHECK:       builtin.module @group2 attributes {hspmd.devices = #dist.devices<"2">, hspmd.pipeline_stage = 0 : i64, hspmd.microbatches = 1 : i64, hspmd.single_stage} {
// CHECK-NEXT:    func.func @train_step() {
// CHECK-NEXT:      %w0 = graph.parameter "layers.0.weight" {{.*}}#dist.layout<"[0]: dup=1 | [2]: dup=1 ; hetero=dup">
// CHECK-NEXT:      %w1 = graph.parameter "layers.1.weight" {{.*}}#dist.layout<"[1]: dup=1 | [2]: dup=1 ; hetero=dup">
// CHECK:           %0 = comm.all_reduce %l {groups = #dist.groups<"{1,2}">} : tensor<f32> -> tensor<f32>
// CHECK:           %8 = graph.matmul %7, %6
// CHECK-NEXT:      %9 = comm.all_reduce %8 {groups = #dist.groups<"{0,2}">} : tensor<4x4xf32> -> tensor<4x4xf32>
// CHECK-NEXT:      %10 = graph.transpose %r
// CHECK-NEXT:      %11 = graph.matmul %10, %3
// CHECK-NEXT:      %12 = comm.all_reduce %11 {groups = #dist.groups<"{1,2}">} : tensor<4x3xf32> -> tensor<4x3xf32>
// CHECK-NEXT:      graph.output "loss", %0 : tensor<f32>
// CHECK-NOT:   pipeline.cross
