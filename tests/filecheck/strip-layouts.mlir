// RUN: hspmd-opt %s -p strip-layouts | filecheck %s

// Annotated IR back to logical IR: the reshards go (their users read their operands), every
// type loses its layout (a callee's signature too), and the recorded strategy goes. The result
// annotates again under another strategy (`hspmd reduce` does so; tests/test_reduce.py).

#dup = #dist.layout<"[0,1]: dup=2">
#split = #dist.layout<"[0,1]: split(0)=2">
builtin.module attributes {dist.strategies = [#dist.strategy<id = 0, "[0,1]: dp=2", microbatches = 1, schedule = "gpipe">]} {
  func.func @train_step() {
    %w = graph.parameter "w" {init = "zeros"} : tensor<8x4xf32, #dup>
    %x = graph.input "x" : tensor<8x4xf32, #split>
    %ws = dist.reshard %w : tensor<8x4xf32, #dup> -> tensor<8x4xf32, #split>
    %s = func.call @layer(%x, %ws) : (tensor<8x4xf32, #split>, tensor<8x4xf32, #split>) -> tensor<8x4xf32, #split>
    %sd = dist.reshard %s : tensor<8x4xf32, #split> -> tensor<8x4xf32, #dup>
    graph.output "s", %sd : tensor<8x4xf32, #dup>
    func.return
  }
  func.func private @layer(%a: tensor<8x4xf32, #split>, %b: tensor<8x4xf32, #split>) -> tensor<8x4xf32, #split> {
    %c = graph.add %a, %b : (tensor<8x4xf32, #split>, tensor<8x4xf32, #split>) -> tensor<8x4xf32, #split>
    func.return %c : tensor<8x4xf32, #split>
  }
}

// CHECK:      builtin.module {
// CHECK-NEXT:   func.func @train_step() {
// CHECK-NEXT:     %w = graph.parameter "w" {init = "zeros"} : tensor<8x4xf32>
// CHECK-NEXT:     %x = graph.input "x" : tensor<8x4xf32>
// CHECK-NEXT:     %s = func.call @layer(%x, %w) : (tensor<8x4xf32>, tensor<8x4xf32>) -> tensor<8x4xf32>
// CHECK-NEXT:     graph.output "s", %s : tensor<8x4xf32>
// CHECK-NEXT:     func.return
// CHECK:        func.func private @layer(%a: tensor<8x4xf32>, %b: tensor<8x4xf32>) -> tensor<8x4xf32> {
// CHECK-NEXT:     %c = graph.add %a, %b : (tensor<8x4xf32>, tensor<8x4xf32>) -> tensor<8x4xf32>
// CHECK-NOT:  dist.

