// RUN: hspmd-opt %s -p 'apply-strategy{strategy="[0,1]: tp=2"}' | filecheck %s --check-prefix=TP2
// RUN: hspmd-opt %s -p 'apply-strategy{strategy="[0-3]: dp=2 tp=2"}' | filecheck %s --check-prefix=MIXED

// Megatron pairs: w1 (its matmul reads the input) is column-parallel, split along its output
// dim, with its bias; w2 (its matmul reads relu(x @ w1 + b1)) is row-parallel, split along its
// input dim; w3 pairs with nothing and stays replicated, as does w2's bias. The optimizer state
// of w1 follows w1. The mesh is dp major, tp minor. (Weights that reach a callee through
// func.call are classified alike: tests/test_tensor_parallel.py.)

builtin.module {
  func.func @train_step() {
    %w1 = graph.parameter "w1" {init = "zeros"} : tensor<4x8xf32>
    %b1 = graph.parameter "b1" {init = "zeros"} : tensor<8xf32>
    %w2 = graph.parameter "w2" {init = "zeros"} : tensor<8x4xf32>
    %b2 = graph.parameter "b2" {init = "zeros"} : tensor<4xf32>
    %w3 = graph.parameter "w3" {init = "zeros"} : tensor<4x4xf32>
    %x = graph.input "x" : tensor<8x4xf32>
    %a = graph.matmul %x, %w1 : (tensor<8x4xf32>, tensor<4x8xf32>) -> tensor<8x8xf32>
    %bb = graph.broadcast %b1 {dims = array<i64: 1>} : (tensor<8xf32>) -> tensor<8x8xf32>
    %c = graph.add %a, %bb : (tensor<8x8xf32>, tensor<8x8xf32>) -> tensor<8x8xf32>
    %r = graph.relu %c : (tensor<8x8xf32>) -> tensor<8x8xf32>
    %o = graph.matmul %r, %w2 : (tensor<8x8xf32>, tensor<8x4xf32>) -> tensor<8x4xf32>
    %ob = graph.broadcast %b2 {dims = array<i64: 1>} : (tensor<4xf32>) -> tensor<8x4xf32>
    %h = graph.add %o, %ob : (tensor<8x4xf32>, tensor<8x4xf32>) -> tensor<8x4xf32>
    %y = graph.matmul %h, %w3 : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
    graph.output "y", %y : tensor<8x4xf32>
    %m = graph.parameter "opt.m.w1" {init = "zeros"} : tensor<4x8xf32>
    func.return
  }
}

// TP2:      %w1 = graph.parameter "w1" {init = "zeros"} : tensor<4x8xf32, #dist.layout<"[0,1]: split(1)=2">>
// TP2-NEXT: %b1 = graph.parameter "b1" {init = "zeros"} : tensor<8xf32, #dist.layout<"[0,1]: split(0)=2">>
// TP2-NEXT: %w2 = graph.parameter "w2" {init = "zeros"} : tensor<8x4xf32, #dist.layout<"[0,1]: split(0)=2">>
// TP2-NEXT: %b2 = graph.parameter "b2" {init = "zeros"} : tensor<4xf32, #dist.layout<"[0,1]: dup=2">>
// TP2-NEXT: %w3 = graph.parameter "w3" {init = "zeros"} : tensor<4x4xf32, #dist.layout<"[0,1]: dup=2">>
// TP2-NEXT: %x = graph.input "x" : tensor<8x4xf32, #dist.layout<"[0,1]: dup=2">>
// TP2:      %m = graph.parameter "opt.m.w1" {init = "zeros"} : tensor<4x8xf32, #dist.layout<"[0,1]: split(1)=2">>

// MIXED:      %w1 = graph.parameter "w1" {init = "zeros"} : tensor<4x8xf32, #dist.layout<"[0-3]: dup=2, split(1)=2">>
// MIXED-NEXT: %b1 = graph.parameter "b1" {init = "zeros"} : tensor<8xf32, #dist.layout<"[0-3]: dup=2, split(0)=2">>
// MIXED-NEXT: %w2 = graph.parameter "w2" {init = "zeros"} : tensor<8x4xf32, #dist.layout<"[0-3]: dup=2, split(0)=2">>
// MIXED-NEXT: %b2 = graph.parameter "b2" {init = "zeros"} : tensor<4xf32, #dist.layout<"[0-3]: dup=4">>
// MIXED-NEXT: %w3 = graph.parameter "w3" {init = "zeros"} : tensor<4x4xf32, #dist.layout<"[0-3]: dup=4">>
// MIXED-NEXT: %x = graph.input "x" : tensor<8x4xf32, #dist.layout<"[0-3]: split(0)=2, dup=2">>
// MIXED:      %m = graph.parameter "opt.m.w1" {init = "zeros"} : tensor<4x8xf32, #dist.layout<"[0-3]: dup=2, split(1)=2">>
