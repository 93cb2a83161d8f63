// RUN: hspmd-opt %s -p 'autodiff,sgd{lr=0.5},apply-strategy{strategy="[0,1]: pp=2 share=3 | [2]: dp=1 share=1" microbatches=2},propagate-layouts,insert-reshard,specialize-groups,lower-reshard,pipeline-split' | filecheck %s

// A heterogeneous pipeline with 2 micro-batches, `[0,1]: pp=2 share=3 | [2]: dp=1 share=1`:
// the pipelined group is annotated as one stage whose 2 micro-batches are virtual dp ranks
// (`[0,1]: dp=2 share=3`), then pipeline-split{virtual="0,1"} cuts it into stage 0 (device 0)
// and stage 1 (device 1). Stage 0 reads the group's 6 rows of x (shares 3:1 of 8) once and
// views them as 2 micro-batches of 3 rows for its pipeline.run; each stage's run sums its
// micro-batches' gradients (and the last stage's their losses), then all-reduces once with
// device 2.

builtin.module {
  func.func @train_step() {
    %w0 = graph.parameter "layers.0.weight" {init = "normal:0.1"} : tensor<4x4xf32>
    %w1 = graph.parameter "layers.1.weight" {init = "normal:0.1"} : tensor<4x3xf32>
    %x = graph.input "x" : tensor<8x4xf32>
    %h = graph.matmul %x, %w0 : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
    %r = graph.relu %h : (tensor<8x4xf32>) -> tensor<8x4xf32>
    %y = graph.matmul %r, %w1 : (tensor<8x4xf32>, tensor<4x3xf32>) -> tensor<8x3xf32>
    %s = graph.reduce_sum %y {dims = array<i64: 0, 1>} : (tensor<8x3xf32>) -> tensor<f32>
    %l = graph.scale %s {factor = 0.125 : f64} : (tensor<f32>) -> tensor<f32>
    graph.output "loss", %l : tensor<f32>
    func.return
  }
}

// CHECK:       builtin.module @group0 attributes {hspmd.devices = #dist.devices<"0">, hspmd.pipeline_stage = 0 : i64, hspmd.microbatches = 2 : i64} {
// CHECK:         %[[X:.*]] = graph.input "x" {global_type = tensor<8x4xf32, #dist.layout<"[0]: dup=1 | [2]: dup=1 ; hetero=split(0), shares=3:1">>} : tensor<6x4xf32>
// CHECK-NEXT:    %[[MB:.*]] = graph.reshape %[[X]] : (tensor<6x4xf32>) -> tensor<2x3x4xf32>
// CHECK:         %[[SUM0:.*]] = pipeline.run @pipeline_forward, @pipeline_backward(%w0, %{{.*}}) (%[[MB]]) {schedule = "gpipe", stage = 0 : i64, stages = 2 : i64, microbatches = 2 : i64, stash = 1 : i64}
// CHECK:         %[[G0:.*]] = comm.all_reduce %[[SUM0]] {groups = #dist.groups<"{0,2}">} : tensor<4x4xf32> -> tensor<4x4xf32>
// CHECK:         optim.sgd %w0, %[[G0]]
// CHECK:       func.func private @pipeline_forward
// CHECK:         comm.send %r {pairs = #dist.pairs<"0->1">, tag = {{[0-9]+}} : i64} : tensor<3x4xf32>
// CHECK:       builtin.module @group1 attributes {hspmd.devices = #dist.devices<"1">, hspmd.pipeline_stage = 1 : i64, hspmd.microbatches = 2 : i64} {
// CHECK:         %[[LOSSES:.*]], %[[SUM1:.*]] = pipeline.run @pipeline_forward, @pipeline_backward
// CHECK-NEXT:    %[[LOSS:.*]] = comm.all_reduce %[[LOSSES]] {groups = #dist.groups<"{1,2}">} : tensor<f32> -> tensor<f32>
// CHECK-NEXT:    comm.send %[[LOSS]] {pairs = #dist.pairs<"1->0">, tag = {{[0-9]+}} : i64} : tensor<f32>
// CHECK:         %[[G1:.*]] = comm.all_reduce %[[SUM1]] {groups = #dist.groups<"{1,2}">} : tensor<4x3xf32> -> tensor<4x3xf32>
// CHECK:       builtin.module @group2 attributes {hspmd.devices = #dist.devices<"2">, hspmd.pipeline_stage = 0 : i64, hspmd.microbatches = 1 : i64, hspmd.single_stage} {
// CHECK:           graph.input "x" {global_type = tensor<8x4xf32, #dist.layout<"[0]: dup=1 | [2]: dup=1 ; hetero=split(0), shares=3:1">>} : tensor<2x4xf32>
// CHECK:           comm.all_reduce %l {groups = #dist.groups<"{1,2}">} : tensor<f32> -> tensor<f32>
// CHECK:           comm.all_reduce %{{.*}} {groups = #dist.groups<"{0,2}">} : tensor<4x4xf32> -> tensor<4x4xf32>
// CHECK:           comm.all_reduce %{{.*}} {groups = #dist.groups<"{1,2}">} : tensor<4x3xf32> -> tensor<4x3xf32>
