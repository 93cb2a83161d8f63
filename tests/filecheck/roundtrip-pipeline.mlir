// RUN: hspmd-opt %s | filecheck %s

// A pipeline stage's physical program reads and prints back: @train_step with one pipeline.run
// of its forward and backward (the runtime walks the 1F1B schedule over 2 micro-batches), tagged
// sends and receives between the stages, and the forward's stash passed to the backward.

builtin.module {
  builtin.module @group0 attributes {hspmd.devices = #dist.devices<"0">, hspmd.pipeline_stage = 0 : i64, hspmd.microbatches = 2 : i64} {
    func.func @train_step() {
      %w = graph.parameter "w" {init = "normal:0.1", global_type = tensor<4x4xf32, #dist.layout<"[0]: dup=1">>} : tensor<4x4xf32>
      %x = graph.input "x@mb" {global_type = tensor<2x3x4xf32, #dist.layout<"[0]: dup=1">>} : tensor<2x3x4xf32>
      %g = pipeline.run @pipeline_forward, @pipeline_backward(%w) (%x) {schedule = "1f1b", stage = 0 : i64, stages = 2 : i64, microbatches = 2 : i64, stash = 1 : i64} : (tensor<4x4xf32>) (tensor<2x3x4xf32>) -> (tensor<4x4xf32>)
      graph.assign "w", %g : tensor<4x4xf32>
      func.return
    }
    func.func private @pipeline_forward(%w: tensor<4x4xf32>, %x: tensor<3x4xf32>) -> tensor<3x4xf32> {
      %h = graph.matmul %x, %w : (tensor<3x4xf32>, tensor<4x4xf32>) -> tensor<3x4xf32>
      comm.send %h {pairs = #dist.pairs<"0->1">, tag = 1 : i64} : tensor<3x4xf32>
      func.return %x : tensor<3x4xf32>
    }
    func.func private @pipeline_backward(%w: tensor<4x4xf32>, %x: tensor<3x4xf32>, %xs: tensor<3x4xf32>) -> tensor<4x4xf32> {
      %dy = comm.recv {pairs = #dist.pairs<"1->0">, tag = 2 : i64} : tensor<3x4xf32>
      %t = graph.transpose %xs {perm = array<i64: 1, 0>} : (tensor<3x4xf32>) -> tensor<4x3xf32>
      %dw = graph.matmul %t, %dy : (tensor<4x3xf32>, tensor<3x4xf32>) -> tensor<4x4xf32>
      func.return %dw : tensor<4x4xf32>
    }
  }
}

// CHECK:      %g = pipeline.run @pipeline_forward, @pipeline_backward(%w) (%x) {schedule = "1f1b", stage = 0 : i64, stages = 2 : i64, microbatches = 2 : i64, stash = 1 : i64} : (tensor<4x4xf32>) (tensor<2x3x4xf32>) -> (tensor<4x4xf32>)
// CHECK:      comm.send %h {pairs = #dist.pairs<"0->1">, tag = 1 : i64} : tensor<3x4xf32>
// CHECK:      %dy = comm.recv {pairs = #dist.pairs<"1->0">, tag = 2 : i64} : tensor<3x4xf32>
