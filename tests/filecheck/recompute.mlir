// RUN: hspmd-opt %s -p recompute{mode=block},autodiff | filecheck %s

// recompute{mode=block} marks the scanned layer; autodiff then keeps only what the layer's
// backward cannot make again: the forward scan returns the stacked input of each layer (not
// tanh(x @ w1), which it would keep otherwise), and @Layer_0_bwd computes the product and the
// tanh again before its own ops.

builtin.module {
  func.func @train_step() {
    %w1 = graph.parameter "l.[0:3].w1" {init = "normal:0.02"} : tensor<3x4x4xf32>
    %w2 = graph.parameter "l.[0:3].w2" {init = "normal:0.02"} : tensor<3x4x4xf32>
    %x = graph.input "x" : tensor<2x4xf32>
    %h = graph.scan @Layer_0(%w1, %w2, %x) {length = 3 : i64, stacked = array<i64: 0, 1>, carry_args = array<i64: 2>, carry_results = array<i64: 0>} : (tensor<3x4x4xf32>, tensor<3x4x4xf32>, tensor<2x4xf32>) -> tensor<2x4xf32>
    %l = graph.reduce_sum %h {dims = array<i64: 0, 1>} : (tensor<2x4xf32>) -> tensor<f32>
    graph.output "loss", %l : tensor<f32>
    func.return
  }
  func.func private @Layer_0(%w1: tensor<4x4xf32>, %w2: tensor<4x4xf32>, %x: tensor<2x4xf32>) -> tensor<2x4xf32> {
    %a = graph.matmul %x, %w1 : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>
    %t = graph.tanh %a : (tensor<2x4xf32>) -> tensor<2x4xf32>
    %y = graph.matmul %t, %w2 : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>
    func.return %y : tensor<2x4xf32>
  }
}

// CHECK-LABEL: func.func @train_step
// CHECK:         [[H:%.*]], [[XS:%.*]] = graph.scan @Layer_0_fwd(%w1, %w2, %x) {{.*}} -> (tensor<2x4xf32>, tensor<3x2x4xf32>)
// CHECK:         graph.scan @Layer_0_bwd({{%.*}}, [[XS]], %w1, %w2) {{.*}}reverse}
// CHECK:       func.func private @Layer_0_bwd({{.*}}) {{.*}} attributes {hspmd.recompute = "block"}
// CHECK-NEXT:    graph.matmul
// CHECK-NEXT:    graph.tanh
// CHECK:         graph.tanh_grad
// CHECK:       func.func private @Layer_0_fwd({{.*}}) -> (tensor<2x4xf32>, tensor<2x4xf32>) attributes {hspmd.recompute = "block"}
// CHECK:         func.return %y, %x
