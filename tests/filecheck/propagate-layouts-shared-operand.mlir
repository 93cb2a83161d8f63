// RUN: hspmd-opt %s -p propagate-layouts,insert-reshard | filecheck %s

// A value made from constants only (%g, as autodiff makes the seed gradient of
// `loss = sum(x @ w + b)`) feeds two consumers: a matmul that wants it batch-split and a
// reduce_sum whose result flows into the replicated parameter's update. Whatever layout %g
// gets, every op's result layout must be the one its sharding rule gives for the operand
// layouts: a reduce_sum over the split dim 0 of a split(0) value is partial (or %g stays
// replicated and so is the sum). insert-reshard checks exactly that, so it must succeed.

#dup = #dist.layout<"[0,1]: dup=2">
#split = #dist.layout<"[0,1]: split(0)=2">
builtin.module {
  func.func @train_step() {
    %b = graph.parameter "b" {init = "zeros"} : tensor<3xf32, #dup>
    %x = graph.input "x" : tensor<8x4xf32, #split>
    %one = graph.constant {value = 1.0 : f64} : tensor<f32>
    %g = graph.broadcast %one {dims = array<i64>} : (tensor<f32>) -> tensor<8x3xf32>
    %gb = graph.reduce_sum %g {dims = array<i64: 0>} : (tensor<8x3xf32>) -> tensor<3xf32>
    %xt = graph.transpose %x {perm = array<i64: 1, 0>} : (tensor<8x4xf32, #split>) -> tensor<4x8xf32>
    %gw = graph.matmul %xt, %g : (tensor<4x8xf32>, tensor<8x3xf32>) -> tensor<4x3xf32>
    %nb = graph.add %b, %gb : (tensor<3xf32, #dup>, tensor<3xf32>) -> tensor<3xf32>
    graph.assign "b", %nb : tensor<3xf32>
    graph.output "gw", %gw : tensor<4x3xf32>
    func.return
  }
}

// CHECK-LABEL: func.func @train_step
// CHECK:         %gb = graph.reduce_sum %g {dims = array<i64: 0>} : {{(\(tensor<8x3xf32, #dist.layout<"\[0,1\]: split\(0\)=2">>\) -> tensor<3xf32, #dist.layout<"\[0,1\]: partial=2">>)|(\(tensor<8x3xf32, #dist.layout<"\[0,1\]: dup=2">>\) -> tensor<3xf32, #dist.layout<"\[0,1\]: dup=2">>)}}
// CHECK:         %gw = graph.matmul {{.*}} -> tensor<4x3xf32, #dist.layout<"[0,1]: partial=2">>
// CHECK:         graph.add %b, {{.*}} -> tensor<3xf32, #dist.layout<"[0,1]: dup=2">>
// CHECK-NEXT:    graph.assign "b", {{.*}} : tensor<3xf32, #dist.layout<"[0,1]: dup=2">>
// CHECK-NEXT:    [[GW:%.*]] = dist.reshard %gw : tensor<4x3xf32, #dist.layout<"[0,1]: partial=2">> -> tensor<4x3xf32, #dist.layout<"[0,1]: dup=2">>
// CHECK-NEXT:    graph.output "gw", [[GW]] : tensor<4x3xf32, #dist.layout<"[0,1]: dup=2">>
