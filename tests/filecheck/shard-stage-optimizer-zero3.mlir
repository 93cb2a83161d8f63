// RUN: hspmd-opt %s -p 'autodiff,adam{lr=0.5},apply-strategy{strategy="[0-3]: dp=2 pp=2 zero=3" microbatches=2},propagate-layouts,insert-reshard,specialize-groups,lower-reshard,pipeline-split,shard-stage-optimizer' | filecheck %s

// shard-stage-optimizer under `[0-3]: dp=2 pp=2 zero=3` with 2 micro-batches: on top of zero=1's
// work, each parameter holds its half between steps (its type is the half, its layout the split
// one), is all-gathered once per step just before the stage's pipeline.run, and the update reads
// and the assign writes the half: no local_split before the update, no all-gather after it.

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

// CHECK:       builtin.module @group0 attributes {hspmd.devices = #dist.devices<"0,1">, hspmd.pipeline_stage = 0 : i64, hspmd.microbatches = 2 : i64} {
// CHECK:         %[[P:.*]] = graph.parameter "layers.0.weight" {init = "normal:0.1", global_type = tensor<4x4xf32, #dist.layout<"[0,1]: split(0)=2">>} : tensor<2x4xf32>
// CHECK:         %[[M:.*]] = graph.parameter "opt.m.layers.0.weight" {init = "zeros", global_type = tensor<4x4xf32, #dist.layout<"[0,1]: split(0)=2">>} : tensor<2x4xf32>
// CHECK:         %[[FULL:.*]] = comm.all_gather %[[P]] {groups = #dist.groups<"{0,1}">, dim = 0 : i64} : tensor<2x4xf32> -> tensor<4x4xf32>
// CHECK-NEXT:    %[[G:.*]] = pipeline.run @pipeline_forward, @pipeline_backward(%[[FULL]],
// CHECK:         %[[GS:.*]] = comm.reduce_scatter %[[G]] {groups = #dist.groups<"{0,1}">, dim = 0 : i64} : tensor<4x4xf32> -> tensor<2x4xf32>
// CHECK-NOT:     comm.local_split
// CHECK:         %[[NEW:.*]], %[[NM:.*]], %[[NV:.*]] = optim.adam %[[P]], %[[GS]], %[[M]]
// CHECK-NOT:     comm.all_gather
// CHECK:         graph.assign "layers.0.weight", %[[NEW]] : tensor<2x4xf32>
// CHECK:         graph.assign "opt.m.layers.0.weight", %[[NM]] : tensor<2x4xf32>
// CHECK:       builtin.module @group1 attributes {hspmd.devices = #dist.devices<"2,3">, hspmd.pipeline_stage = 1 : i64, hspmd.microbatches = 2 : i64} {
// CHECK:         graph.parameter "layers.1.weight" {init = "normal:0.1", global_type = tensor<4x3xf32, #dist.layout<"[2,3]: split(0)=2">>} : tensor<2x3xf32>
// CHECK:         comm.all_gather %{{.*}} {groups = #dist.groups<"{2,3}">, dim = 0 : i64} : tensor<2x3xf32> -> tensor<4x3xf32>
// CHECK:         pipeline.run
// CHECK:         comm.reduce_scatter %{{.*}} {groups = #dist.groups<"{2,3}">, dim = 0 : i64} : tensor<4x3xf32> -> tensor<2x3xf32>
// CHECK-NOT:     comm.all_gather
