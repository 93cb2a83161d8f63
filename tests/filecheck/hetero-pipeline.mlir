// RUN: hspmd-opt %s -p 'autodiff,sgd{lr=0.5},apply-strategy{strategy="[0,1]: pp=2 share=3 | [2]: dp=1 share=1"},propagate-layouts,insert-reshard,specialize-groups,lower-reshard,pipeline-split' | filecheck %s

// A heterogeneous pipeline, `[0,1]: pp=2 share=3 | [2]: dp=1 share=1`: the union is annotated
// with the pipelined group as its first stage's shape (`[0]: dp=1 share=3`), then
// pipeline-split{virtual="0"} cuts only that group's program into stage 0 (device 0) and stage
// 1 (device 1). Each cross-group collective runs on the stage that computes its operand, over
// that stage's real device and device 2: the layer-0 gradient sum over [0, 2], the loss and the
// layer-1 gradient sum over [1, 2]. Group [2] names, per op, the same stage; its parameters'
// layouts name the stage that owns them; it is marked as a one-stage pipeline. Its collectives
// come in an order every stage agrees with (loss with stage 1, layer 0 with stage 0, layer 1
// with stage 1).

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

// CHECK:       builtin.module @group0 attributes {hspmd.devices = #dist.devices<"0">, hspmd.pipeline_stage = 0 : i64, hspmd.microbatches = 1 : i64} {
// CHECK:         graph.parameter "layers.0.weight" {{.*}}#dist.layout<"[0]: dup=1 | [2]: dup=1 ; hetero=dup">
// CHECK-NEXT:    graph.input "x@mb" {global_type = tensor<1x8x4xf32, #dist.layout<"[0]: dup=1 | [2]: dup=1 ; hetero=split(1), shares=3:1">>} : tensor<1x6x4xf32>
// CHECK:         %[[G0:.*]] = pipeline.run @pipeline_forward, @pipeline_backward
// CHECK:         optim.sgd %w0, %[[G0]]
// CHECK:       func.func private @pipeline_forward
// CHECK:         comm.send %r {pairs = #dist.pairs<"0->1">, tag = {{[0-9]+}} : i64} : tensor<6x4xf32>
// CHECK:       func.func private @pipeline_backward
// CHECK:         %[[G:.*]] = comm.all_reduce %{{.*}} {groups = #dist.groups<"{0,2}">} : tensor<4x4xf32> -> tensor<4x4xf32>
// CHECK-NEXT:    func.return %[[G]]
// CHECK-NOT:     layers.1.weight
// CHECK:       builtin.module @group1 attributes {hspmd.devices = #dist.devices<"1">, hspmd.pipeline_stage = 1 : i64, hspmd.microbatches = 1 : i64} {
// CHECK:         graph.parameter "layers.1.weight" {{.*}}#dist.layout<"[1]: dup=1 | [2]: dup=1 ; hetero=dup">
// CHECK:         %[[LOSS:.*]], %[[G1:.*]] = pipeline.run @pipeline_forward, @pipeline_backward
// CHECK-NEXT:    comm.send %[[LOSS]] {pairs = #dist.pairs<"1->0">, tag = {{[0-9]+}} : i64} : tensor<f32>
// CHECK:         optim.sgd %w1, %[[G1]]
// CHECK:       func.func private @pipeline_forward
// CHECK:         comm.all_reduce %l {groups = #dist.groups<"{1,2}">} : tensor<f32> -> tensor<f32>
// CHECK:       func.func private @pipeline_backward
// CHECK:         comm.all_reduce %{{.*}} {groups = #dist.groups<"{1,2}">} : tensor<4x3xf32> -> tensor<4x3xf32>
// CHECK:       builtin.module @group2 attributes {hspmd.devices = #dist.devices<"2">, hspmd.pipeline_stage = 0 : i64, hspmd.microbatches = 1 : i64, hspmd.single_stage} {
// CHECK-NEXT:    func.func @train_step() {
// CHECK-NEXT:      graph.parameter "layers.0.weight" {{.*}}#dist.layout<"[0]: dup=1 | [2]: dup=1 ; hetero=dup">
// CHECK-NEXT:      graph.parameter "layers.1.weight" {{.*}}#dist.layout<"[1]: dup=1 | [2]: dup=1 ; hetero=dup">
// CHECK:           comm.all_reduce %l {groups = #dist.groups<"{1,2}">} : tensor<f32> -> tensor<f32>
// CHECK:           comm.all_reduce %{{.*}} {groups = #dist.groups<"{0,2}">} : tensor<4x4xf32> -> tensor<4x4xf32>
// CHECK:           comm.all_reduce %{{.*}} {groups = #dist.groups<"{1,2}">} : tensor<4x3xf32> -> tensor<4x3xf32>
