// RUN: hspmd-opt %s -p propagate-layouts | filecheck %s

// From the layouts on the leaves, every value gets one: a matmul of batch-split x by a
// replicated w stays batch-split; the bias broadcast is made split like the activations it
// is added to (not replicated, then cut); a constant takes the layout its consumer needs;
// summing over the split dim leaves partial sums; a value nobody constrains is replicated.
// No dist.reshard is inserted: that is insert-reshard's job.

builtin.module {
  func.func @train_step() {
    %w = graph.parameter "w" {init = "zeros"} : tensor<4x3xf32, #dist.layout<"[0,1]: dup=2">>
    %b = graph.parameter "b" {init = "zeros"} : tensor<3xf32, #dist.layout<"[0,1]: dup=2">>
    %x = graph.input "x" : tensor<8x4xf32, #dist.layout<"[0,1]: split(0)=2">>
    %y = graph.matmul %x, %w : (tensor<8x4xf32, #dist.layout<"[0,1]: split(0)=2">>, tensor<4x3xf32, #dist.layout<"[0,1]: dup=2">>) -> tensor<8x3xf32>
    %bb = graph.broadcast %b {dims = array<i64: 1>} : (tensor<3xf32, #dist.layout<"[0,1]: dup=2">>) -> tensor<8x3xf32>
    %z = graph.add %y, %bb : (tensor<8x3xf32>, tensor<8x3xf32>) -> tensor<8x3xf32>
    %c = graph.constant {value = 2.0 : f64} : tensor<8x3xf32>
    %m = graph.mul %z, %c : (tensor<8x3xf32>, tensor<8x3xf32>) -> tensor<8x3xf32>
    %l = graph.reduce_sum %m {dims = array<i64: 0, 1>} : (tensor<8x3xf32>) -> tensor<f32>
    graph.output "loss", %l : tensor<f32>
    %k = graph.constant {value = 3.0 : f64} : tensor<2xf32>
    graph.output "k", %k : tensor<2xf32>
    func.return
  }
}

// CHECK-LABEL: func.func @train_step
// CHECK-NOT:   dist.reshard
// CHECK:       %y = graph.matmul %x, %w : ({{.*}}) -> tensor<8x3xf32, #dist.layout<"[0,1]: split(0)=2">>
// CHECK-NEXT:  %bb = graph.broadcast %b {dims = array<i64: 1>} : (tensor<3xf32, #dist.layout<"[0,1]: dup=2">>) -> tensor<8x3xf32, #dist.layout<"[0,1]: split(0)=2">>
// CHECK-NEXT:  %z = graph.add %y, %bb : (tensor<8x3xf32, #dist.layout<"[0,1]: split(0)=2">>, tensor<8x3xf32, #dist.layout<"[0,1]: split(0)=2">>) -> tensor<8x3xf32, #dist.layout<"[0,1]: split(0)=2">>
// CHECK-NEXT:  %c = graph.constant {value = 2.000000e+00 : f64} : tensor<8x3xf32, #dist.layout<"[0,1]: split(0)=2">>
// CHECK-NEXT:  %m = graph.mul %z, %c : ({{.*}}) -> tensor<8x3xf32, #dist.layout<"[0,1]: split(0)=2">>
// CHECK-NEXT:  %l = graph.reduce_sum %m {dims = array<i64: 0, 1>} : (tensor<8x3xf32, #dist.layout<"[0,1]: split(0)=2">>) -> tensor<f32, #dist.layout<"[0,1]: partial=2">>
// CHECK-NEXT:  graph.output "loss", %l : tensor<f32, #dist.layout<"[0,1]: partial=2">>
// CHECK-NEXT:  %k = graph.constant {value = 3.000000e+00 : f64} : tensor<2xf32, #dist.layout<"[0,1]: dup=2">>
// CHECK-NEXT:  graph.output "k", %k : tensor<2xf32, #dist.layout<"[0,1]: dup=2">>
// CHECK-NOT:   dist.reshard
