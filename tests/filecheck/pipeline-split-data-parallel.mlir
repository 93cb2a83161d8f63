// RUN: hspmd-opt %s -p 'autodiff,sgd{lr=0.5},apply-strategy{strategy="[0-3]: dp=4"},propagate-layouts,insert-reshard,specialize-groups,lower-reshard,pipeline-split{devices="0,1,2,3" pp=2 microbatches=2}' | filecheck %s

// pipeline-split on a data-parallel stage: `[0-3]: dp=2 pp=2` with 2 micro-batches is compiled
// as `[0-3]: dp=4` (micro-batches x dp ranks), then cut into stage 0 on devices 0,1 and stage 1
// on 2,3. Each stage takes micro-batch inputs x@mb0, x@mb1 (4 rows, split over its 2 dp ranks),
// sends activations from position q of stage 0 to position q of stage 1, sums the micro-batches'
// gradients locally (graph.add), then all-reduces them over its own dp ranks before the update.

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

// CHECK:       builtin.module @group0 attributes {hspmd.devices = array<i64: 0, 1>, hspmd.pipeline_stage = 0 : i64, hspmd.microbatches = 2 : i64} {
// CHECK:         %w0 = graph.parameter "layers.0.weight" {{.*}}global_type = tensor<4x4xf32, #dist.layout<"[0,1]: dup=2">>} : tensor<4x4xf32>
// CHECK-NEXT:    %x = graph.input "x@mb0" {global_type = tensor<4x4xf32, #dist.layout<"[0,1]: split(0)=2">>} : tensor<2x4xf32>
// CHECK:         comm.send %r {pairs = [array<i64: 0, 2>, array<i64: 1, 3>]} : tensor<2x4xf32>
// CHECK-NEXT:    %x_1 = graph.input "x@mb1"
// CHECK:         comm.send %r_1 {pairs = [array<i64: 0, 2>, array<i64: 1, 3>]} : tensor<2x4xf32>
// CHECK:         %[[G0:.*]] = graph.matmul %{{.*}}, %{{.*}} : (tensor<4x2xf32>, tensor<2x4xf32>) -> tensor<4x4xf32>
// CHECK:         %[[G1:.*]] = graph.matmul %{{.*}}, %{{.*}} : (tensor<4x2xf32>, tensor<2x4xf32>) -> tensor<4x4xf32>
// CHECK:         %[[SUM:.*]] = graph.add %[[G0]], %[[G1]] : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
// CHECK-NEXT:    %[[RED:.*]] = comm.all_reduce %[[SUM]] {groups = [array<i64: 0, 1>]} : tensor<4x4xf32> -> tensor<4x4xf32>
// CHECK:         optim.sgd %w0, %[[RED]]
// CHECK-NOT:     layers.1.weight
// CHECK:       builtin.module @group1 attributes {hspmd.devices = array<i64: 2, 3>, hspmd.pipeline_stage = 1 : i64, hspmd.microbatches = 2 : i64} {
// CHECK:         graph.parameter "layers.1.weight" {{.*}}#dist.layout<"[2,3]: dup=2">
// CHECK-NEXT:    comm.recv {pairs = [array<i64: 0, 2>, array<i64: 1, 3>]} : tensor<2x4xf32>
// CHECK:         %[[LOSS:.*]] = graph.add %l, %l_1 : (tensor<f32>, tensor<f32>) -> tensor<f32>
// CHECK-NEXT:    %[[TOTAL:.*]] = comm.all_reduce %[[LOSS]] {groups = [array<i64: 2, 3>]} : tensor<f32> -> tensor<f32>
// CHECK-NEXT:    comm.send %[[TOTAL]] {pairs = [array<i64: 2, 0>, array<i64: 3, 1>]} : tensor<f32>
// CHECK-NEXT:    graph.output "loss", %[[TOTAL]] : tensor<f32>
// CHECK:         comm.all_reduce %{{.*}} {groups = [array<i64: 2, 3>]} : tensor<4x3xf32> -> tensor<4x3xf32>
