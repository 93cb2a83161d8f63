// RUN: hspmd-opt %s -p 'autodiff,sgd{lr=0.5},apply-strategy{strategy="[0-3]: dp=2 pp=2" microbatches=2},propagate-layouts,insert-reshard,specialize-groups,lower-reshard,pipeline-split' | filecheck %s

// pipeline-split on a data-parallel stage: `[0-3]: dp=2 pp=2` with 2 micro-batches is compiled
// as `[0-3]: dp=4` (micro-batches x dp ranks), then cut into stage 0 on devices 0,1 and stage 1
// on 2,3. Each stage's @train_step runs one pipeline.run of its @pipeline_forward and
// @pipeline_backward on each micro-batch (the runtime walks the schedule); stage 0 reads x as
// x@mb, 2 micro-batches of 4 rows split over its 2 dp ranks along dim 1, and sends activations
// from position q to position q of stage 1; the run's results are the gradients summed over the
// micro-batches, all-reduced once over the stage's dp ranks before the update. The activation's
// gradient does not depend on the micro-batch here (the loss is linear in y): stage 1 makes it
// once before its run and stage 0's backwards share it.

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
// CHECK:         %w0 = graph.parameter "layers.0.weight" {{.*}}global_type = tensor<4x4xf32, #dist.layout<"[0,1]: dup=2">>} : tensor<4x4xf32>
// CHECK-NEXT:    %[[X:.*]] = graph.input "x@mb" {global_type = tensor<2x4x4xf32, #dist.layout<"[0,1]: split(1)=2">>} : tensor<2x2x4xf32>
// CHECK-NEXT:    %[[DR:.*]] = comm.recv {pairs = #dist.pairs<"2,3->0,1">, tag = [[TDR:[0-9]+]] : i64} : tensor<2x4xf32>
// CHECK-NEXT:    %[[G:.*]] = pipeline.run @pipeline_forward, @pipeline_backward(%w0, %[[DR]]) (%[[X]]) {schedule = "gpipe", stage = 0 : i64, stages = 2 : i64, microbatches = 2 : i64, stash = 1 : i64}
// CHECK-NEXT:    %[[LOSS0:.*]] = comm.recv {pairs = #dist.pairs<"2,3->0,1">, tag = [[TLOSS:[0-9]+]] : i64} : tensor<f32>
// CHECK-NEXT:    graph.output "loss", %[[LOSS0]] : tensor<f32>
// CHECK:         %[[RED:.*]] = comm.all_reduce %[[G]] {groups = #dist.groups<"{0,1}">} : tensor<4x4xf32> -> tensor<4x4xf32>
// CHECK:         optim.sgd %w0, %[[RED]]
// CHECK:       func.func private @pipeline_forward(%{{.*}}: tensor<4x4xf32>, %{{.*}}: tensor<2x4xf32>, %{{.*}}: tensor<2x4xf32>) -> tensor<2x4xf32> {
// CHECK:         %r = graph.relu
// CHECK-NEXT:    comm.send %r {pairs = #dist.pairs<"0,1->2,3">, tag = [[TACT:[0-9]+]] : i64} : tensor<2x4xf32>
// CHECK-NEXT:    func.return %h : tensor<2x4xf32>
// CHECK:       func.func private @pipeline_backward(%{{.*}}: tensor<4x4xf32>, %[[DY:.*]]: tensor<2x4xf32>, %{{.*}}: tensor<2x4xf32>, %[[H:.*]]: tensor<2x4xf32>) -> tensor<4x4xf32> {
// CHECK-NEXT:    graph.relu_grad %[[H]], %[[DY]]
// CHECK-NOT:     layers.1.weight
// CHECK:       builtin.module @group1 attributes {hspmd.devices = #dist.devices<"2,3">, hspmd.pipeline_stage = 1 : i64, hspmd.microbatches = 2 : i64} {
// CHECK:         graph.parameter "layers.1.weight" {{.*}}#dist.layout<"[2,3]: dup=2">
// CHECK:         comm.send %{{.*}} {pairs = #dist.pairs<"2,3->0,1">, tag = [[TDR]] : i64} : tensor<2x4xf32>
// CHECK-NEXT:    %[[L:.*]], %[[G1:.*]] = pipeline.run @pipeline_forward, @pipeline_backward(%w1, %{{.*}}) () {schedule = "gpipe", stage = 1 : i64, stages = 2 : i64, microbatches = 2 : i64, stash = 1 : i64} : (tensor<4x3xf32>, tensor<2x3xf32>) () -> (tensor<f32>, tensor<4x3xf32>)
// CHECK-NEXT:    %[[TOTAL:.*]] = comm.all_reduce %[[L]] {groups = #dist.groups<"{2,3}">} : tensor<f32> -> tensor<f32>
// CHECK-NEXT:    comm.send %[[TOTAL]] {pairs = #dist.pairs<"2,3->0,1">, tag = [[TLOSS]] : i64} : tensor<f32>
// CHECK-NEXT:    graph.output "loss", %[[TOTAL]] : tensor<f32>
// CHECK:         comm.all_reduce %[[G1]] {groups = #dist.groups<"{2,3}">} : tensor<4x3xf32> -> tensor<4x3xf32>
// CHECK:       func.func private @pipeline_forward(%{{.*}}: tensor<4x3xf32>, %{{.*}}: tensor<2x3xf32>) -> (tensor<2x4xf32>, tensor<f32>) {
// CHECK-NEXT:    %[[A:.*]] = comm.recv {pairs = #dist.pairs<"0,1->2,3">, tag = [[TACT]] : i64} : tensor<2x4xf32>
// CHECK:         func.return %[[A]], %l : tensor<2x4xf32>, tensor<f32>
