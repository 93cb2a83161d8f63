// RUN: hspmd-opt %s -p 'autodiff,sgd{lr=0.5},apply-strategy{strategy="[0,1]: dp=2"},propagate-layouts,insert-reshard,specialize-groups,lower-reshard' | filecheck %s

// The whole compiler on a forward-only step, logical to physical: one module for ranks
// 0,1 with the batch halved (8 -> 4 rows), parameters whole, no dist op left, and an
// all_reduce over both ranks for the loss and for each gradient before its update.

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
    %l = graph.scale %s {factor = 0.125 : f64} : (tensor<f32>) -> tensor<f32>
    graph.output "loss", %l : tensor<f32>
    func.return
  }
}

// CHECK:       builtin.module attributes {dist.strategies = [#dist.strategy<id = 0, "[0,1]: dp=2", microbatches = 1, schedule = "gpipe">]} {
// CHECK-NEXT:    builtin.module @group0 attributes {hspmd.devices = #dist.devices<"0,1">} {
// CHECK-NEXT:      func.func @train_step() {
// CHECK-NEXT:        %w = graph.parameter "w" {init = "normal:0.1", global_type = tensor<4x3xf32, #dist.layout<"[0,1]: dup=2">>} : tensor<4x3xf32>
// CHECK-NEXT:        %b = graph.parameter "b" {init = "zeros", global_type = tensor<3xf32, #dist.layout<"[0,1]: dup=2">>} : tensor<3xf32>
// CHECK-NEXT:        %x = graph.input "x" {global_type = tensor<8x4xf32, #dist.layout<"[0,1]: split(0)=2">>} : tensor<4x4xf32>
// CHECK-NEXT:        %y = graph.matmul %x, %w : (tensor<4x4xf32>, tensor<4x3xf32>) -> tensor<4x3xf32>
// CHECK-NOT:         {{dist\.reshard|comm\.}}
// CHECK:             %l = graph.scale %s {{.*}} : (tensor<f32>) -> tensor<f32>
// CHECK-NEXT:        [[LOSS:%.*]] = comm.all_reduce %l {groups = #dist.groups<"{0,1}">} : tensor<f32> -> tensor<f32>
// CHECK-NEXT:        graph.output "loss", [[LOSS]] : tensor<f32>
// CHECK:             [[GW:%.*]] = comm.all_reduce %7 {groups = #dist.groups<"{0,1}">} : tensor<4x3xf32> -> tensor<4x3xf32>
// CHECK-NEXT:        [[NW:%.*]] = optim.sgd %w, [[GW]], {{%.*}} {{.*}} : (tensor<4x3xf32>, tensor<4x3xf32>, tensor<f64>) -> tensor<4x3xf32>
// CHECK-NEXT:        graph.assign "w", [[NW]] : tensor<4x3xf32>
// CHECK-NEXT:        [[GB:%.*]] = comm.all_reduce %5 {groups = #dist.groups<"{0,1}">} : tensor<3xf32> -> tensor<3xf32>
// CHECK-NEXT:        [[NB:%.*]] = optim.sgd %b, [[GB]], {{%.*}} {{.*}} : (tensor<3xf32>, tensor<3xf32>, tensor<f64>) -> tensor<3xf32>
// CHECK-NEXT:        graph.assign "b", [[NB]] : tensor<3xf32>
// CHECK-NEXT:        func.return
// CHECK-NEXT:      }
// CHECK-NEXT:    }
// CHECK-NEXT:  }
